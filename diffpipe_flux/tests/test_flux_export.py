"""Exports without training: ComfyUI LoRA keys and exact fusing (also with some q/k/v parts not adapted),
and full fine-tunes written as a diffusers folder or a BFL single file that load back to the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.adapters import lora_state_dict
from diffpipe_core.schema import validate
from diffpipe_core.testing import runs
from diffpipe_flux.bfl import bfl_to_diffusers, diffusers_to_bfl
from diffpipe_flux.config import FluxConfig
from diffpipe_flux.plugin import plugin as flux
from diffpipe_flux.testing import TinyFluxConfig, tiny_transformer


def lora_model(targets: list[str], rank: int = 4):
    model = tiny_transformer(TinyFluxConfig())
    runs.with_random_lora(model, targets, rank)
    return model


def merged_diffusers(model, alpha: float, rank: int) -> dict[str, torch.Tensor]:
    base = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
    return runs.merge_peft(base, lora_state_dict(model), alpha / rank)


@pytest.mark.parametrize(
    "targets",
    [
        ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
        ["attn.to_k", "ff.net.2", "norm_out.linear"],  # partial q/k/v, and the final adaLN (shift/scale swapped)
    ],
)
def test_comfyui_lora_applies_like_the_separate_loras(targets: list[str]) -> None:
    model = lora_model(targets)
    state = lora_state_dict(model)
    comfy = flux.export_adapter(state_dict=state, alpha=6.0, rank=4, format="comfyui")
    assert all(k.startswith("diffusion_model.") for k in comfy)
    base = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
    got = bfl_to_diffusers(runs.apply_comfyui(diffusers_to_bfl(base), comfy))
    expected = merged_diffusers(model, 6.0, 4)
    for key in expected:
        assert torch.allclose(got[key], expected[key], atol=1e-6), key
    if "attn.to_k" in targets and "attn.to_q" not in targets:
        assert comfy["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"].shape == (4, 32)
        assert float(comfy["diffusion_model.double_blocks.0.img_attn.qkv.alpha"]) == 6.0
        assert float(comfy["diffusion_model.single_blocks.0.linear1.alpha"]) == 6.0


def test_diffusers_format_and_unknown_format() -> None:
    state = lora_state_dict(lora_model(["attn.to_q"]))
    out = flux.export_adapter(state_dict=state, alpha=6.0, rank=4, format="diffusers")
    assert set(out) == {f"transformer.{k}" for k in state}
    assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in out
    assert flux.export_adapter(state_dict=state, alpha=6.0, rank=4, format="kohya") is None


def test_comfyui_rejects_modules_without_a_bfl_counterpart() -> None:
    state = {"pos_embed.foo.lora_A.weight": torch.zeros(4, 8), "pos_embed.foo.lora_B.weight": torch.zeros(8, 4)}
    with pytest.raises(ValueError, match="pos_embed.foo"):
        flux.export_adapter(state_dict=state, alpha=4.0, rank=4, format="comfyui")


def test_full_model_exports_load_back(tiny_flux: Path, tmp_path: Path) -> None:
    table = {"type": "flux", "path": tiny_flux, "dtype": "float32"}
    cfg = validate(FluxConfig, table, "test")
    model = flux.load_diffusion_model(cfg, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        model.transformer_blocks[0].attn.to_q.weight.add_(1.0)  # "fine-tuned"
    # what the core's write_model_shards leaves for 2 stages: shards keyed by state_dict names + an index
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    saved = runs.write_saved_model(state, tmp_path / "saved")

    for fmt in ("single_file", "diffusers"):
        assert flux.export_model(saved_dir=saved, model_config=cfg, out_dir=saved / fmt, format=fmt)
    assert flux.export_model(saved_dir=saved, model_config=cfg, out_dir=saved / "x", format="ckpt") is None
    bfl_file = saved / "single_file" / "flux1-transformer.safetensors"
    assert "double_blocks.0.img_attn.qkv.weight" in load_file(str(bfl_file))
    from_bfl = flux.load_diffusion_model(
        validate(FluxConfig, {**table, "diffusion_model": bfl_file}, "test"), torch.device("cpu"), torch.float32
    )
    from diffusers import FluxTransformer2DModel

    from_folder = FluxTransformer2DModel.from_pretrained(str(saved / "diffusers"))
    for key, value in state.items():
        assert torch.equal(from_bfl.state_dict()[key], value), key
        assert torch.equal(from_folder.state_dict()[key], value), key
