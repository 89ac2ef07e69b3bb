"""Exports without training: the ComfyUI LoRA's native keys and exact fusing (also with some q/k/v parts not
adapted), and full fine-tunes written as a diffusers folder or an original-layout single file that load back
to the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.adapters import lora_state_dict
from diffpipe_core.schema import validate
from diffpipe_core.testing import runs
from diffpipe_hunyuan.config import HunyuanConfig
from diffpipe_hunyuan.original import diffusers_to_original, original_to_diffusers
from diffpipe_hunyuan.plugin import plugin as hy
from diffpipe_hunyuan.testing import TinyHunyuanConfig, apply_comfyui_lora, tiny_transformer

A = ".lora_A.weight"


def lora_model(targets: list[str], rank: int = 4):
    model = tiny_transformer(TinyHunyuanConfig())
    runs.with_random_lora(model, targets, rank)
    return model


def base_state(model) -> dict[str, torch.Tensor]:
    return {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}


def merged_diffusers(model, alpha: float, rank: int) -> dict[str, torch.Tensor]:
    return runs.merge_peft(base_state(model), lora_state_dict(model), alpha / rank)


@pytest.mark.parametrize("partial", [False, True])
def test_comfyui_lora_applies_like_the_separate_loras(tiny_hunyuan: Path, partial: bool) -> None:
    table = {"type": "hunyuan-video", "path": tiny_hunyuan}
    targets = hy.lora_targets(validate(HunyuanConfig, table, "test"))
    if partial:  # q/k/v parts missing from the fused modules, a single block's MLP part not adapted
        targets = [t for t in targets if t.endswith(("attn.to_k", "attn.add_v_proj", "norm1.linear", "proj_out"))]
    model = lora_model(targets)
    comfy = hy.export_adapter(state_dict=lora_state_dict(model), alpha=6.0, rank=4, format="comfyui")
    assert all(k.startswith("diffusion_model.") for k in comfy)
    got = original_to_diffusers(apply_comfyui_lora(diffusers_to_original(base_state(model)), comfy))
    expected = merged_diffusers(model, 6.0, 4)
    for key in expected:
        assert torch.allclose(got[key], expected[key], atol=1e-6), key
    fused = [("double_blocks.0.img_attn.qkv", 3), ("double_blocks.1.txt_attn.qkv", 3), ("single_blocks.0.linear1", 4)]
    for module, parts in fused:
        adapted = 1 if partial else parts
        assert comfy[f"diffusion_model.{module}.lora_A.weight"].shape == (4 * adapted, 32)
        assert float(comfy[f"diffusion_model.{module}.alpha"]) == 6.0 * adapted
    assert float(comfy["diffusion_model.double_blocks.0.img_mod.lin.alpha"]) == 6.0
    if not partial:
        names = {k.rsplit(".", 2)[0] if k.endswith("weight") else k.rsplit(".", 1)[0] for k in comfy}
        per_double = {"img_attn.qkv", "txt_attn.qkv", "img_attn.proj", "txt_attn.proj", "img_mlp.0", "img_mlp.2"}
        per_double |= {"txt_mlp.0", "txt_mlp.2", "img_mod.lin", "txt_mod.lin"}
        expected_names = {f"diffusion_model.double_blocks.{i}.{m}" for i in range(2) for m in per_double}
        expected_names |= {f"diffusion_model.single_blocks.{i}.{m}" for i in range(2) for m in ("linear1", "linear2")}
        expected_names |= {f"diffusion_model.single_blocks.{i}.modulation.lin" for i in range(2)}
        assert names == expected_names


def test_diffusers_format_unknown_format_and_unmapped_modules() -> None:
    state = lora_state_dict(lora_model(["transformer_blocks.0.attn.to_q"]))
    out = hy.export_adapter(state_dict=state, alpha=6.0, rank=4, format="diffusers")
    assert set(out) == {f"transformer.{k}" for k in state}
    assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in out
    assert hy.export_adapter(state_dict=state, alpha=6.0, rank=4, format="kohya") is None
    refiner = lora_state_dict(lora_model(["context_embedder.token_refiner.refiner_blocks.0.attn.to_q"]))
    with pytest.raises(ValueError, match=r"refiner_blocks\.0\.attn\.to_q"):
        hy.export_adapter(state_dict=refiner, alpha=4.0, rank=4, format="comfyui")


def test_full_model_exports_load_back(tiny_hunyuan: Path, tmp_path: Path) -> None:
    from diffusers import HunyuanVideoTransformer3DModel

    table = {"type": "hunyuan-video", "path": tiny_hunyuan, "dtype": "float32"}
    cfg = validate(HunyuanConfig, table, "test")
    model = hy.load_diffusion_model(cfg, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        model.single_transformer_blocks[1].proj_mlp.weight.add_(1.0)  # "fine-tuned"
    saved = tmp_path / "saved"
    state = runs.export_full_finetune(hy, model, cfg, saved)
    assert hy.export_model(saved_dir=saved, model_config=cfg, out_dir=saved / "x", format="ckpt") is None
    single = saved / "single_file" / "hunyuan_video_transformer.safetensors"
    assert "double_blocks.0.img_attn_qkv.weight" in load_file(str(single))
    single_cfg = validate(HunyuanConfig, {**table, "diffusion_model": single}, "test")
    from_single = hy.load_diffusion_model(single_cfg, torch.device("cpu"), torch.float32).state_dict()
    from_folder = HunyuanVideoTransformer3DModel.from_pretrained(str(saved / "diffusers")).state_dict()
    for key, value in state.items():
        assert torch.equal(from_single[key], value), key
        assert torch.equal(from_folder[key], value), key
