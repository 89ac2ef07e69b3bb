"""Issue 10, test 5: a BFL single-file Flux loaded per stage. Each of 2 stages reads only its own keys from the
file (counted on the real safetensors reader), splits only its own blocks' fused tensors, and gets exactly the
weights a whole load gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import diffpipe_core.engine.model_loading as model_loading
from diffpipe_core.engine.model_loading import load_for_stages, materialise_layers
from diffpipe_core.engine.partition import stage_parts
from diffpipe_core.registry import get_registry
from diffpipe_core.schema import validate
from diffpipe_flux.config import FluxConfig
from diffpipe_flux.testing import bfl_path


class CountingReader:
    """The real ``safe_open`` handle, recording which keys are read."""

    def __init__(self, handle, reads: list[str]) -> None:
        self.handle, self.reads = handle, reads

    def __enter__(self) -> CountingReader:
        self.handle.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.handle.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        self.reads.append(key)
        return self.handle.get_tensor(key)


def test_bfl_single_file_is_read_per_stage(tiny_flux: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = get_registry().model("flux")
    table = {"type": "flux", "path": tiny_flux, "dtype": "float32", "transformer_file": bfl_path(tiny_flux)}
    cfg = validate(FluxConfig, table, "test")
    whole = plugin.require("load_diffusion_model", model_config=cfg, device=torch.device("cpu"), dtype=torch.float32)
    expected = whole.state_dict()
    with safe_open(str(bfl_path(tiny_flux)), "pt") as f:
        file_keys = set(f.keys())

    reads: dict[int, list[str]] = {0: [], 1: []}
    loaded: dict[int, set[str]] = {}
    for stage_id in (0, 1):
        monkeypatch.setattr(
            model_loading, "safe_open", lambda *a, _r=reads[stage_id], **kw: CountingReader(safe_open(*a, **kw), _r)
        )
        stage = load_for_stages(plugin, cfg, torch.device("cpu"), torch.float32)
        assert stage.per_stage_loading and all(p.device.type == "meta" for p in stage.model.parameters())
        parts = stage_parts(stage.layers, 2)
        materialise_layers(plugin, cfg, stage, range(parts[stage_id], parts[stage_id + 1]), torch.device("cpu"))
        real = {n: t for n, t in stage.model.state_dict().items() if t.device.type != "meta"}
        for name, tensor in real.items():
            assert torch.equal(tensor, expected[name]), name
        loaded[stage_id] = set(real)

    assert loaded[0] and loaded[1] and not loaded[0] & loaded[1]
    assert loaded[0] | loaded[1] == set(expected)
    first, second = set(reads[0]), set(reads[1])
    # every key read once, by the one stage that needs it: the two stages together read the file exactly once
    assert len(reads[0]) == len(first) and len(reads[1]) == len(second)
    assert not first & second and first | second == file_keys
    print(f"BFL file: {len(file_keys)} keys; stage 0 read {len(first)}, stage 1 read {len(second)}")
    # each stage split only the fused tensors of its own blocks
    fused = {k for k in file_keys if k.endswith(("qkv.weight", "linear1.weight"))}
    assert first & fused and second & fused
    assert all(k.startswith("double_blocks.") for k in first & fused)
    assert any(k.startswith("single_blocks.") for k in second & fused)
