"""FLUX.1 Kontext [dev] from the files ComfyUI users keep (issue 35): ``flux1-kontext-dev.safetensors`` (BFL's layout
under ``model.diffusion_model.``), ``ae.safetensors``, ``clip_l.safetensors`` and ``t5xxl_fp16.safetensors``, beside
a folder of only configs and tokenizers or the Hugging Face cache's snapshot of FLUX.1-Kontext-dev: the weights load
exactly as the folder's, and an fp8 scaled transformer stays quantized and loads per stage (Kontext's files are
Flux's: test_flux_component_files.py writes them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_flux_component_files import comfy_files

from diffpipe_core.schema import ConfigError, validate
from diffpipe_core.testing.component_files import (
    assert_kept_quantized,
    assert_loads_as_the_folder,
    assert_variant_loads_as_itself,
    hub_snapshot,
    quantize_file,
    variant_file,
    variant_model,
)
from diffpipe_flux.config import FluxKontextConfig
from diffpipe_flux.kontext import plugin as kontext

REPO = "black-forest-labs/FLUX.1-Kontext-dev"


@pytest.fixture(scope="module")
def comfy(tiny_flux: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return comfy_files(tiny_flux, tmp_path_factory.mktemp("comfy"))


def config(path: Path | None, comfy: dict, **keys) -> FluxKontextConfig:
    """The tiny Kontext's ``[model]`` table at ``path`` (None: absent) with ``comfy``'s files (none when empty; the
    text encoders T5 first: which encoder each holds is read from its tensors)."""
    table = {"type": "flux-kontext", "dtype": "float32", "encoder_dtype": "float32", "t5_max_length": 8}
    if comfy:
        given = {"diffusion_model": comfy["diffusion_model"], "vae": comfy["vae"]}
        table |= {**given, "text_encoders": comfy["text_encoders"][::-1], **keys}
    return validate(FluxKontextConfig, table if path is None else {**table, "path": path}, "test")


def test_component_files_load_exactly_the_folders_weights(tiny_flux: Path, comfy: dict) -> None:
    cfg = config(comfy["configs"], comfy)
    lines = "\n".join(kontext.model_file_lines(cfg))
    assert "diffusion_model: " in lines and "BFL layout" in lines and f"vae: {comfy['vae']}: LDM layout" in lines
    assert "(CLIPTextModel)" in lines and "(T5EncoderModel)" in lines
    assert_loads_as_the_folder(kontext, cfg, config(tiny_flux, {}), ("vae", "text_encoder", "text_encoder_2"))


def test_configs_from_the_hugging_face_cache(tiny_flux: Path, comfy: dict, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError, match=rf"no snapshot of {REPO} .*hf download {REPO}"):
        config(None, comfy)
    snapshot = hub_snapshot(tiny_flux, tmp_path / "hub", REPO)
    cfg = config(None, comfy)
    assert cfg.path == snapshot and kontext.validate_model_files(cfg) == []


def test_a_quantized_transformer_stays_quantized(comfy: dict, tmp_path: Path) -> None:
    name = "flux1-kontext-dev_fp8_scaled.safetensors"
    cfg = config(
        comfy["configs"], comfy, diffusion_model=quantize_file(comfy["diffusion_model"], tmp_path / name, "fp8_scaled")
    )
    assert_kept_quantized(kontext, cfg, config(comfy["configs"], comfy), torch.float8_e4m3fn)


def test_a_file_of_another_variant_loads_as_itself(comfy: dict, tmp_path: Path) -> None:
    """Other block counts and heads than the folder's config: read from the file's tensors."""
    read = {"num_layers": 1, "num_single_layers": 3, "num_attention_heads": 3}
    variant = variant_model(kontext, comfy["configs"], **read)
    file = variant_file(kontext, variant, tmp_path / "kontext.safetensors")
    assert_variant_loads_as_itself(kontext, config(comfy["configs"], comfy, diffusion_model=file), variant, read)
