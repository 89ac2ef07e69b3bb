"""Chroma from the files ComfyUI users keep (issue 35): ``Chroma1-HD.safetensors`` (Chroma's original layout under
``model.diffusion_model.``), ``ae.safetensors`` (Flux's VAE in the LDM layout) and ``t5xxl_fp16.safetensors`` (T5 in
transformers' names), beside a folder of only configs and tokenizers or the Hugging Face cache's snapshot of them: the
weights load exactly as the folder's, and an fp8 scaled transformer stays quantized and loads per stage."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from diffpipe_core.parts.ldm import vae_table
from diffpipe_core.schema import ConfigError, validate
from diffpipe_core.testing.component_files import (
    assert_kept_quantized,
    assert_loads_as_the_folder,
    assert_trains_as,
    assert_variant_loads_as_itself,
    comfyui_files,
    hub_snapshot,
    model_keys,
    quantize_file,
    train_from_files,
    variant_file,
    variant_model,
)
from diffpipe_flux.chroma import plugin as chroma
from diffpipe_flux.chroma_keys import layout_for_config
from diffpipe_flux.config import ChromaConfig

REPO = "lodestones/Chroma1-HD"


@pytest.fixture(scope="module")
def comfy(tiny_chroma: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny Chroma as ComfyUI component files and a config-only folder ``configs``."""
    return comfyui_files(
        tiny_chroma, tmp_path_factory.mktemp("comfy"), layout_for_config, partial(vae_table, prefix="")
    )


def config(path: Path | None, comfy: dict, **keys) -> ChromaConfig:
    """The tiny Chroma's ``[model]`` table at ``path`` (None: absent) with ``comfy``'s files (none when empty)."""
    table = {"type": "chroma", "dtype": "float32", "encoder_dtype": "float32", "t5_max_length": 8, **keys}
    if comfy:
        table |= {"diffusion_model": comfy["diffusion_model"], "vae": comfy["vae"], **keys}
        table.setdefault("text_encoders", comfy["text_encoders"])
    return validate(ChromaConfig, table if path is None else {**table, "path": path}, "test")


def test_component_files_load_exactly_the_folders_weights(tiny_chroma: Path, comfy: dict) -> None:
    cfg = config(comfy["configs"], comfy)
    lines = "\n".join(chroma.model_file_lines(cfg))
    assert "diffusion_model: " in lines and "Chroma layout" in lines
    assert f"vae: {comfy['vae']}: LDM layout" in lines
    assert f"text_encoder: {comfy['text_encoders'][0]}: diffusers," in lines and "(T5EncoderModel)" in lines
    assert_loads_as_the_folder(chroma, cfg, config(tiny_chroma, {}), ("vae", "text_encoder"))


def test_configs_from_the_hugging_face_cache(tiny_chroma: Path, comfy: dict, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError, match=rf"no snapshot of {REPO} .*hf download {REPO}"):
        config(None, comfy)
    snapshot = hub_snapshot(tiny_chroma, tmp_path / "hub", REPO)
    cfg = config(None, comfy)
    assert cfg.path == snapshot and chroma.validate_model_files(cfg) == []


def test_a_quantized_transformer_stays_quantized(comfy: dict, tmp_path: Path) -> None:
    file = quantize_file(comfy["diffusion_model"], tmp_path / "chroma_fp8_scaled.safetensors", "fp8_scaled")
    cfg = config(comfy["configs"], comfy, diffusion_model=file)
    assert_kept_quantized(chroma, cfg, config(comfy["configs"], comfy), torch.float8_e4m3fn)


def test_a_file_of_another_variant_loads_as_itself(comfy: dict, tmp_path: Path) -> None:
    """Other block counts, heads and approximator depth than the folder's config: read from the file's tensors."""
    read = {"num_layers": 1, "num_single_layers": 3, "num_attention_heads": 3, "approximator_layers": 3}
    variant = variant_model(chroma, comfy["configs"], **read)
    file = variant_file(chroma, variant, tmp_path / "chroma.safetensors")
    assert_variant_loads_as_itself(chroma, config(comfy["configs"], comfy, diffusion_model=file), variant, read)


@pytest.mark.slow
def test_component_files_train_as_the_folder(chroma_run: Path, tmp_path: Path) -> None:
    """The shared Chroma run (original single file over the folder), again from ComfyUI files only: equal losses
    and LoRA files."""
    from test_chroma_train import make_project

    config = make_project(tmp_path)
    files = comfyui_files(tmp_path / "model", tmp_path / "comfy", layout_for_config, partial(vae_table, prefix=""))
    assert_trains_as(train_from_files(tmp_path, config, model_keys(files)), chroma_run)
