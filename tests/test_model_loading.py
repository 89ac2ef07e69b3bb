"""Per-stage loading: a rank reads only its own stage's tensors from the weight files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffpipe_core.engine.model_loading import load_for_stages, materialise_layers
from diffpipe_core.engine.partition import stage_parts
from diffpipe_core.registry import PluginError, get_registry
from diffpipe_reference.model import write_tiny_model


def setup(tmp_path: Path):
    plugin = get_registry().model("reference")
    cfg = plugin.spec.config_schema(type="reference", path=write_tiny_model(tmp_path / "m"))
    return plugin, cfg, load_for_stages(plugin, cfg, torch.device("cpu"), torch.float32)


def test_only_own_stage_is_materialised(tmp_path: Path) -> None:
    plugin, cfg, stage = setup(tmp_path)
    assert stage.per_stage_loading and all(p.device.type == "meta" for p in stage.model.parameters())
    parts = stage_parts(stage.layers, 2)
    materialise_layers(plugin, cfg, stage, range(parts[1], parts[2]), torch.device("cpu"))
    file = load_file(str(tmp_path / "m" / "transformer.safetensors"))
    real = {n for n, p in stage.model.named_parameters() if p.device.type != "meta"}
    assert real and len(real) < len(file)
    for i, layer in enumerate(stage.layers):
        devices = {p.device.type for p in layer.parameters()}
        assert devices == ({"cpu"} if parts[1] <= i < parts[2] else {"meta"}), f"layer {i}"
    for name in real:
        assert torch.equal(dict(stage.model.named_parameters())[name], file[name])


def test_missing_tensor_in_weight_file_is_named(tmp_path: Path) -> None:
    plugin, cfg, stage = setup(tmp_path)
    weights = tmp_path / "m" / "transformer.safetensors"
    state = load_file(str(weights))
    del state["blocks.0.fc1.weight"]
    save_file(state, str(weights))
    with pytest.raises(PluginError, match="blocks.0.fc1.weight"):
        materialise_layers(plugin, cfg, stage, range(len(stage.layers)), torch.device("cpu"))
