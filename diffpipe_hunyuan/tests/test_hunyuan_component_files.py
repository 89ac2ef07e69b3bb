"""HunyuanVideo from the files ComfyUI users keep (issue 35): ``hunyuan_video_t2v_720p_bf16.safetensors`` (Tencent's
layout under ``model.diffusion_model.``), ``hunyuan_video_vae_bf16.safetensors`` (in ComfyUI's LDM names with 3-D
convolutions, or in Tencent's, which are diffusers'), ``llava_llama3_fp16.safetensors`` (Llama under ComfyUI's
``model.``) and ``clip_l.safetensors``, beside a folder of only configs and tokenizers: the weights load exactly as
the folder's (a transformer ComfyUI saved, in its own module names, too), and an fp8 scaled transformer stays quantized
and loads per stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.testing.component_files import (
    assert_kept_quantized,
    assert_loads_as_the_folder,
    assert_variant_loads_as_itself,
    comfyui_files,
    component_state,
    quantize_file,
    save,
    variant_file,
    variant_model,
)
from diffpipe_hunyuan.original import comfyui_layout, layout_for_config
from diffpipe_hunyuan.plugin import plugin as hunyuan
from diffpipe_hunyuan.testing import tiny_config
from diffpipe_hunyuan.vae_layouts import ldm_vae_table

ENCODERS = ("vae", "text_encoder", "text_encoder_2")
LLAMA_PREFIX = "model."  # ComfyUI's llava_llama3 file: the language model under model.


@pytest.fixture(scope="module")
def comfy(tiny_hunyuan: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny HunyuanVideo as ComfyUI files (the VAE in ComfyUI's LDM names) and a config-only folder."""
    out = tmp_path_factory.mktemp("comfy")
    return comfyui_files(tiny_hunyuan, out, layout_for_config, ldm_vae_table, {"text_encoder": LLAMA_PREFIX})


def from_files(comfy: dict, crop: int, **keys):
    """The files in the order ComfyUI's loader lists them (CLIP first): which encoder each holds is read from them."""
    given = {"diffusion_model": comfy["diffusion_model"], "vae": comfy["vae"]}
    given["text_encoders"] = comfy["text_encoders"][::-1]
    return tiny_config(comfy["configs"], crop, **{**given, **keys})


def test_component_files_load_exactly_the_folders_weights(tiny_hunyuan: Path, comfy: dict, crop_start: int) -> None:
    cfg = from_files(comfy, crop_start)
    lines = "\n".join(hunyuan.model_file_lines(cfg))
    assert "diffusion_model: " in lines and "original Tencent layout" in lines
    assert f"vae: {comfy['vae']}: ComfyUI LDM (3-D) layout" in lines
    assert f"text_encoder: {comfy['text_encoders'][0]}: diffusers (under 'model')" in lines and "(LlamaModel)" in lines
    assert f"text_encoder_2: {comfy['text_encoders'][1]}: diffusers" in lines and "(CLIPTextModel)" in lines
    held = load_file(str(comfy["vae"]))  # the mid attention's linears as 1x1x1 convolutions, the levels reversed
    assert held["encoder.mid.attn_1.q.weight"].dim() == 5 and "decoder.up.3.block.0.conv1.conv.weight" in held
    assert_loads_as_the_folder(hunyuan, cfg, tiny_config(tiny_hunyuan, crop_start), ENCODERS)


def test_the_vae_in_tencents_names_loads_too(tiny_hunyuan: Path, comfy: dict, crop_start: int, tmp_path) -> None:
    """Tencent's VAE file names its tensors as diffusers does: read without a table."""
    tencent = save(component_state(tiny_hunyuan, "vae"), tmp_path / "hunyuan_video_vae_bf16.safetensors")
    cfg = from_files(comfy, crop_start, vae=tencent)
    assert f"vae: {tencent}: diffusers," in "\n".join(hunyuan.model_file_lines(cfg))
    assert_loads_as_the_folder(hunyuan, cfg, tiny_config(tiny_hunyuan, crop_start), ENCODERS)


def test_a_transformer_saved_by_comfyui_loads_too(tiny_hunyuan: Path, comfy: dict, crop_start: int, tmp_path) -> None:
    """ComfyUI's own module names (``img_attn.qkv``, ``img_attn.norm.query_norm.scale``, ``img_mod.lin``,
    ``txt_in.t_embedder.in_layer``, ...), as a file saved by ComfyUI holds them."""
    table = comfyui_layout(layout_for_config(json.loads((tiny_hunyuan / "transformer/config.json").read_text())))
    state = table.to_original(component_state(tiny_hunyuan, "transformer"))
    native = save(
        {f"model.diffusion_model.{k}": v for k, v in state.items()}, tmp_path / "saved_by_comfyui.safetensors"
    )
    held = {k.removeprefix("model.diffusion_model.") for k in load_file(str(native))}
    assert {"double_blocks.0.img_attn.norm.query_norm.scale", "single_blocks.1.modulation.lin.weight"} <= held
    assert {"txt_in.individual_token_refiner.blocks.0.self_attn.qkv.weight", "time_in.in_layer.weight"} <= held
    cfg = from_files(comfy, crop_start, diffusion_model=native)
    assert (
        "diffusion_model: " in hunyuan.model_file_lines(cfg)[0] and "ComfyUI layout" in hunyuan.model_file_lines(cfg)[0]
    )
    assert_loads_as_the_folder(hunyuan, cfg, tiny_config(tiny_hunyuan, crop_start), ENCODERS)


def test_a_quantized_transformer_stays_quantized(comfy: dict, crop_start: int, tmp_path: Path) -> None:
    file = quantize_file(comfy["diffusion_model"], tmp_path / "hunyuan_video_fp8_scaled.safetensors", "fp8_scaled")
    cfg = from_files(comfy, crop_start, diffusion_model=file)
    assert_kept_quantized(hunyuan, cfg, from_files(comfy, crop_start), torch.float8_e4m3fn)


def test_a_file_of_another_variant_loads_as_itself(comfy: dict, crop_start: int, tmp_path: Path) -> None:
    """Other block counts and heads, and no guidance embedder, than the folder's config: read from the file."""
    read = {"num_layers": 1, "num_single_layers": 3, "num_attention_heads": 3, "guidance_embeds": False}
    variant = variant_model(hunyuan, comfy["configs"], **read)
    file = variant_file(hunyuan, variant, tmp_path / "hunyuan.safetensors")
    assert_variant_loads_as_itself(hunyuan, from_files(comfy, crop_start, diffusion_model=file), variant, read)
