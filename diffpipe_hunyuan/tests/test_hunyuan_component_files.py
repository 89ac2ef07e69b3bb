"""HunyuanVideo from the files ComfyUI users keep (issue 35): ``hunyuan_video_t2v_720p_bf16.safetensors`` (Tencent's
layout under ``model.diffusion_model.``), ``hunyuan_video_vae_bf16.safetensors`` (in ComfyUI's LDM names with 3-D
convolutions, or in Tencent's, which are diffusers'), ``llava_llama3_fp16.safetensors`` (Llama under ComfyUI's
``model.``) and ``clip_l.safetensors``, beside a folder of only configs and tokenizers: the weights load exactly as
the folder's, and an fp8 scaled transformer stays quantized and loads per stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.quantize import ScaledLinear
from diffpipe_core.registry import Registry
from diffpipe_core.testing.component_files import (
    assert_same_state,
    component_state,
    config_only,
    quantizable_linears,
    quantize_file,
    save,
    write_component_files,
)
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_hunyuan.original import layout_for_config
from diffpipe_hunyuan.plugin import plugin as hunyuan
from diffpipe_hunyuan.testing import tiny_config
from diffpipe_hunyuan.vae_layouts import ldm_vae_table

CPU = torch.device("cpu")
LLAMA_PREFIX = "model."  # ComfyUI's llava_llama3 file: the language model under model.


def comfy_files(folder: Path, out: Path) -> dict:
    """``folder`` as ComfyUI component files under ``out`` (the VAE in ComfyUI's LDM names) and a config-only folder
    ``out/configs``."""
    config = json.loads((folder / "transformer" / "config.json").read_text())
    vae = json.loads((folder / "vae" / "config.json").read_text())
    files = write_component_files(
        folder, out, layout_for_config(config), ldm_vae_table(vae), {"text_encoder": LLAMA_PREFIX}
    )
    files["configs"] = config_only(folder, out / "configs")
    return files


@pytest.fixture(scope="module")
def comfy(tiny_hunyuan: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return comfy_files(tiny_hunyuan, tmp_path_factory.mktemp("comfy"))


def from_files(comfy: dict, crop: int, **keys):
    """The files in the order ComfyUI's loader lists them (CLIP first): which encoder each holds is read from them."""
    given = {"diffusion_model": comfy["diffusion_model"], "vae": comfy["vae"]}
    given["text_encoders"] = comfy["text_encoders"][::-1]
    return tiny_config(comfy["configs"], crop, **{**given, **keys})


def test_component_files_load_exactly_the_folders_weights(tiny_hunyuan: Path, comfy: dict, crop_start: int) -> None:
    cfg = from_files(comfy, crop_start)
    assert hunyuan.validate_model_files(cfg) == []
    lines = "\n".join(hunyuan.model_file_lines(cfg))
    assert "diffusion_model: " in lines and "original Tencent layout" in lines
    assert f"vae: {comfy['vae']}: ComfyUI LDM (3-D) layout" in lines
    assert f"text_encoder: {comfy['text_encoders'][0]}: diffusers (under 'model')" in lines and "(LlamaModel)" in lines
    assert f"text_encoder_2: {comfy['text_encoders'][1]}: diffusers" in lines and "(CLIPTextModel)" in lines
    folder = tiny_config(tiny_hunyuan, crop_start)
    got, expected = hunyuan.load_encoders(cfg, CPU), hunyuan.load_encoders(folder, CPU)
    for name in ("vae", "text_encoder", "text_encoder_2"):
        assert_same_state(getattr(got, name).state_dict(), getattr(expected, name).state_dict())
    for dtype in (torch.float32, torch.bfloat16):
        assert_same_state(
            hunyuan.load_diffusion_model(cfg, CPU, dtype).state_dict(),
            hunyuan.load_diffusion_model(folder, CPU, dtype).state_dict(),
        )


def test_the_vae_in_tencents_names_loads_too(tiny_hunyuan: Path, comfy: dict, crop_start: int, tmp_path) -> None:
    """Tencent's VAE file names its tensors as diffusers does: read without a table; the 3-D LDM file's mid attention
    holds 1x1x1 convolutions, which load as the diffusers VAE's linears."""
    tencent = save(component_state(tiny_hunyuan, "vae"), tmp_path / "hunyuan_video_vae_bf16.safetensors")
    cfg = from_files(comfy, crop_start, vae=tencent)
    assert f"vae: {tencent}: diffusers," in "\n".join(hunyuan.model_file_lines(cfg))
    assert_same_state(
        hunyuan.load_encoders(cfg, CPU).vae.state_dict(),
        hunyuan.load_encoders(from_files(comfy, crop_start), CPU).vae.state_dict(),
    )
    held = load_file(str(comfy["vae"]))
    assert held["encoder.mid.attn_1.q.weight"].dim() == 5 and "decoder.up.3.block.0.conv1.conv.weight" in held


def test_a_quantized_transformer_stays_quantized(comfy: dict, crop_start: int, tmp_path: Path) -> None:
    file = quantize_file(comfy["diffusion_model"], tmp_path / "hunyuan_video_fp8_scaled.safetensors", "fp8_scaled")
    cfg = from_files(comfy, crop_start, diffusion_model=file)
    assert hunyuan.validate_model_files(cfg) == []
    model = hunyuan.load_diffusion_model(cfg, CPU, torch.bfloat16)
    kept = {n: m for n, m in model.named_modules() if isinstance(m, ScaledLinear)}
    plain = hunyuan.load_diffusion_model(from_files(comfy, crop_start), CPU, torch.bfloat16)
    assert set(kept) == quantizable_linears(plain)  # q, k and v cut from their fused tensor each
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in kept.values())
    assert f"{len(kept)} linears kept quantized" in hunyuan.model_file_lines(cfg)[0]
    registry = Registry()
    assert registry.register_model("hunyuan-video", hunyuan).ok
    assert_stages_read_their_own(registry.model("hunyuan-video"), cfg)
