"""Exports without training: LoRA formats and errors, and full fine-tunes written as a diffusers folder or an original
NVIDIA single file that load back to the same weights (for both entry points)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cosmos_common import PLUGINS
from safetensors.torch import load_file

from diffpipe_core.adapters import apply_lora, lora_config, lora_state_dict
from diffpipe_core.schema import validate
from diffpipe_core.testing.runs import write_saved_model
from diffpipe_cosmos.plugin import LORA_TARGETS, cosmos1, predict2
from diffpipe_cosmos.testing import TinyCosmosConfig, tiny_transformer


def test_lora_formats_and_unknown_format() -> None:
    model = tiny_transformer(TinyCosmosConfig(variant="1.0"))
    apply_lora(model, lora_config(4, 6.0, 0.0, list(LORA_TARGETS)))
    state = lora_state_dict(model)
    plugin = cosmos1
    out = plugin.export_adapter(state_dict=state, alpha=6.0, rank=4, format="diffusers")
    assert set(out) == {f"transformer.{k}" for k in state}
    comfy = plugin.export_adapter(state_dict=state, alpha=6.0, rank=4, format="comfyui")
    assert torch.equal(
        comfy["diffusion_model.blocks.block1.blocks.1.block.attn.to_out.0.lora_B.weight"],
        state["transformer_blocks.1.attn2.to_out.0.lora_B.weight"],
    )
    assert float(comfy["diffusion_model.blocks.block0.blocks.2.block.layer1.alpha"]) == 6.0
    assert plugin.export_adapter(state_dict=state, alpha=6.0, rank=4, format="kohya") is None
    p2 = predict2.export_adapter(state_dict=state, alpha=6.0, rank=4, format="comfyui")
    assert "diffusion_model.blocks.1.cross_attn.output_proj.lora_B.weight" in p2
    assert "diffusion_model.blocks.0.mlp.layer2.alpha" in p2


def test_comfyui_rejects_modules_without_an_original_counterpart() -> None:
    state = {"rope.foo.lora_A.weight": torch.zeros(4, 8), "rope.foo.lora_B.weight": torch.zeros(8, 4)}
    with pytest.raises(ValueError, match="rope.foo"):
        predict2.export_adapter(state_dict=state, alpha=4.0, rank=4, format="comfyui")


@pytest.mark.parametrize("name", ["cosmos", "cosmos-predict2"])
def test_full_model_exports_load_back(tiny_models: dict[str, Path], tmp_path: Path, name: str) -> None:
    plugin = PLUGINS[name]
    table = {"type": name, "path": tiny_models[name], "dtype": "float32"}
    cfg = validate(plugin.spec.config_schema, table, "test")
    model = plugin.load_diffusion_model(cfg, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        model.transformer_blocks[0].attn1.to_q.weight.add_(1.0)  # "fine-tuned"
    # what the core's write_model_shards leaves for 2 stages: shards keyed by state_dict names + an index
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    saved = write_saved_model(state, tmp_path / "saved")

    for fmt in ("single_file", "diffusers"):
        assert plugin.export_model(saved_dir=saved, model_config=cfg, out_dir=saved / fmt, format=fmt)
    assert plugin.export_model(saved_dir=saved, model_config=cfg, out_dir=saved / "x", format="ckpt") is None
    single = next((saved / "single_file").glob("*.safetensors"))
    assert all(k.startswith("net.") for k in load_file(str(single)))
    assert plugin.validate_model_files(validate(type(cfg), {**table, "diffusion_model": single}, "test")) == []
    from_single = plugin.load_diffusion_model(
        validate(type(cfg), {**table, "diffusion_model": single}, "test"), torch.device("cpu"), torch.float32
    )
    from diffusers import CosmosTransformer3DModel

    from_folder = CosmosTransformer3DModel.from_pretrained(str(saved / "diffusers"))
    for key, value in state.items():
        assert torch.equal(from_single.state_dict()[key], value), key
        assert torch.equal(from_folder.state_dict()[key], value), key
