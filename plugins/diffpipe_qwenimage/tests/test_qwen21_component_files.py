"""Qwen-Image 2.1 from component files (issue 35's core): the transformer as ComfyUI loads it (diffusers names under
``model.diffusion_model.``), the VAE and Qwen3-VL as files beside a folder of only configs and the processor, loading
exactly as the folder; ComfyUI's fp8 scaled and int8 transformers kept quantized, each stage reading its own tensors;
configs from the Hugging Face cache's snapshot of the published repository."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.component_files import cached_snapshot
from diffpipe_core.schema import validate
from diffpipe_core.testing.component_files import (
    assert_kept_quantized,
    assert_loads_as_the_folder,
    comfyui_files,
    files_config,
    hub_snapshot,
    quantize_file,
)
from diffpipe_qwenimage.config import QwenImage21Config, QwenImage21TurboConfig
from diffpipe_qwenimage.qwen21 import plugin


def from_files(files: dict, schema=QwenImage21Config, **keys):
    return files_config(schema, "qwen-image-2.1", files, **keys)


def test_component_files_load_exactly_the_folders_weights(tiny_qwen21: Path, tmp_path: Path) -> None:
    files = comfyui_files(tiny_qwen21, tmp_path)
    cfg = from_files(files)
    folder = validate(QwenImage21Config, {"type": "qwen-image-2.1", "path": tiny_qwen21, "encoder_dtype": "float32"},
                      "test")
    assert_loads_as_the_folder(plugin, cfg, folder, ("vae", "text_encoder"))
    lines = "\n".join(plugin.model_file_lines(cfg))
    assert f"diffusion_model: {files['diffusion_model']}: diffusers (under 'model.diffusion_model')" in lines
    assert "(Qwen3VLForConditionalGeneration)" in lines and "(AutoencoderKLQwenImage21)" in lines


@pytest.mark.parametrize(("form", "storage"), [("fp8_scaled", torch.float8_e4m3fn), ("int8_convrot", torch.int8)])
def test_a_quantized_transformer_stays_quantized(tiny_qwen21: Path, tmp_path: Path, form: str, storage) -> None:
    files = comfyui_files(tiny_qwen21, tmp_path)
    quantized = quantize_file(files["diffusion_model"], tmp_path / f"qwen_image_2.1_{form}.safetensors", form)
    assert_kept_quantized(plugin, from_files(files, diffusion_model=quantized), from_files(files), storage)


def test_configs_from_the_hugging_face_cache(tiny_qwen21_turbo: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match=r"no snapshot of Qwen/Qwen-Image-2.1-Turbo"):
        cached_snapshot(QwenImage21TurboConfig.hub_repos, "qwen-image-2.1-turbo")
    files = comfyui_files(tiny_qwen21_turbo, tmp_path / "comfy")
    snapshot = hub_snapshot(tiny_qwen21_turbo, tmp_path / "hub", "Qwen/Qwen-Image-2.1-Turbo")
    table = {"type": "qwen-image-2.1-turbo", "diffusion_model": files["diffusion_model"], "vae": files["vae"],
             "text_encoders": files["text_encoders"]}
    cfg = validate(QwenImage21TurboConfig, table, "test")
    assert cfg.path == snapshot and plugin.validate_model_files(cfg) == []
