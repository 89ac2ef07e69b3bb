"""Qwen-Image and Qwen-Image-Edit from the files ComfyUI users keep (issue 35): the transformer in diffusers' names
under ``model.diffusion_model.`` (``qwen_image_bf16.safetensors``), the VAE in the original Wan VAE layout
(``qwen_image_vae.safetensors``), Qwen2.5-VL as ComfyUI holds it (``qwen_2.5_vl_7b.safetensors``: ``model.*``,
``visual.*``, ``lm_head``, which transformers 5 calls ``model.language_model.*`` and ``model.visual.*``), beside a
folder of only configs, tokenizers and the processor; ComfyUI's fp8 scaled transformer kept quantized, each stage
reading its own tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from diffpipe_core.component_files import cached_snapshot
from diffpipe_core.parts.wan_vae import wan_vae_table
from diffpipe_core.schema import validate
from diffpipe_core.testing.component_files import (
    assert_kept_quantized,
    assert_variant_loads_as_itself,
    config_only,
    dequantized_state,
    hub_snapshot,
    quantize_file,
    variant_file,
    variant_model,
    write_component_files,
)
from diffpipe_qwenimage.config import QwenImageEditConfig
from diffpipe_qwenimage.edit import plugin as edit
from diffpipe_qwenimage.plugin import plugin as qwen

CPU = torch.device("cpu")


def comfy_files(folder: Path, out: Path) -> dict:
    """``folder`` as ComfyUI's Qwen-Image files under ``out`` and a config-only folder ``out/configs``."""
    vae = json.loads((folder / "vae" / "config.json").read_text())
    files = write_component_files(folder, out, vae_table=wan_vae_table(vae))
    files["configs"] = config_only(folder, out / "configs")
    return files


def from_files(plugin, files: dict, **keys):
    table = {"type": plugin.spec.name, "path": files["configs"], "diffusion_model": files["diffusion_model"]}
    table.update(vae=files["vae"], text_encoders=[{"path": files["text_encoders"][0], "type": "qwen_image"}])
    return validate(plugin.spec.config_schema, {**table, "encoder_dtype": "float32", **keys}, "test")


def same_state(got: nn.Module, expected: nn.Module) -> None:
    a, b = got.state_dict(), expected.state_dict()
    assert a.keys() == b.keys() and len(a) > 10
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(("fixture", "plugin"), [("tiny_qwen", qwen), ("tiny_edit_plus", edit)])
def test_component_files_load_exactly_the_folders_weights(request, tmp_path: Path, fixture: str, plugin) -> None:
    folder = request.getfixturevalue(fixture)
    files = comfy_files(folder, tmp_path)
    cfg = from_files(plugin, files)
    assert plugin.validate_model_files(cfg) == []
    lines = "\n".join(plugin.model_file_lines(cfg))
    assert f"diffusion_model: {files['diffusion_model']}: diffusers (under 'model.diffusion_model')" in lines
    assert f"vae: {files['vae']}: original Wan VAE layout" in lines
    assert f"text_encoder: {files['text_encoders'][0]}: diffusers" in lines
    assert "(Qwen2_5_VLForConditionalGeneration)" in lines
    text_keys = set(load_file(str(files["text_encoders"][0])))  # ComfyUI's names, not transformers 5's
    assert {"model.embed_tokens.weight", "visual.patch_embed.proj.weight", "lm_head.weight"} <= text_keys
    folder_cfg = validate(plugin.spec.config_schema, {"type": plugin.spec.name, "path": folder}, "test")
    got = plugin.load_encoders(cfg, CPU)
    expected = plugin.load_encoders(folder_cfg.model_copy(update={"encoder_dtype": "float32"}), CPU)
    for name in ("vae", "text_encoder"):
        same_state(getattr(got, name), getattr(expected, name))
    same_state(
        plugin.load_diffusion_model(cfg, CPU, torch.bfloat16),
        plugin.load_diffusion_model(folder_cfg, CPU, torch.bfloat16),
    )


def test_a_quantized_transformer_stays_quantized(tiny_qwen: Path, tmp_path: Path) -> None:
    files = comfy_files(tiny_qwen, tmp_path)
    file = quantize_file(files["diffusion_model"], tmp_path / "qwen_image_fp8_e4m3fn.safetensors", "fp8_scaled")
    cfg = from_files(qwen, files, diffusion_model=file)
    assert_kept_quantized(qwen, cfg, from_files(qwen, files), torch.float8_e4m3fn)


def test_an_fp8_scaled_qwen25_vl_loads_dequantized(tiny_qwen: Path, tmp_path: Path) -> None:
    files = comfy_files(tiny_qwen, tmp_path)
    te = quantize_file(files["text_encoders"][0], tmp_path / "qwen_2.5_vl_7b_fp8_scaled.safetensors", "fp8_scaled")
    encoder = qwen.load_encoders(from_files(qwen, files, text_encoders=[te]), CPU).text_encoder
    values = dequantized_state(te)
    named = {
        k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v for k, v in values.items()
    }
    named = {f"model.{k}" if k.startswith("visual.") else k: v for k, v in named.items()}
    state = encoder.state_dict()
    assert named.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(tensor, named[name]), name


def test_configs_from_the_hugging_face_cache(tiny_edit_plus: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match=r"no snapshot of Qwen/Qwen-Image-Edit-2509 or Qwen/Qwen-Image-Edit"):
        cached_snapshot(QwenImageEditConfig.hub_repos, "qwen-image-edit")
    files = comfy_files(tiny_edit_plus, tmp_path / "comfy")
    snapshot = hub_snapshot(tiny_edit_plus, tmp_path / "hub", "Qwen/Qwen-Image-Edit")
    table = {"type": "qwen-image-edit", "diffusion_model": files["diffusion_model"], "vae": files["vae"]}
    cfg = validate(QwenImageEditConfig, {**table, "text_encoders": files["text_encoders"]}, "test")
    assert cfg.path == snapshot and edit.validate_model_files(cfg) == []
    assert "the Hugging Face cache" in edit.model_file_lines(cfg)[0]


def test_a_file_of_another_variant_loads_as_itself(tiny_qwen: Path, tmp_path: Path) -> None:
    """Other block count and heads than the folder's config: read from the file's tensors."""
    files = comfy_files(tiny_qwen, tmp_path)
    read = {"num_layers": 3, "num_attention_heads": 3}
    variant = variant_model(qwen, files["configs"], **read)
    file = variant_file(qwen, variant, tmp_path / "qwen.safetensors")
    assert_variant_loads_as_itself(qwen, from_files(qwen, files, diffusion_model=file), variant, read)
