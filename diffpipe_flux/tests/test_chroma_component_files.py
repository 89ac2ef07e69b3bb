"""Chroma from the files ComfyUI users keep (issue 35): ``Chroma1-HD.safetensors`` (Chroma's original layout under
``model.diffusion_model.``), ``ae.safetensors`` (Flux's VAE in the LDM layout) and ``t5xxl_fp16.safetensors`` (T5 in
transformers' names), beside a folder of only configs and tokenizers or the Hugging Face cache's snapshot of them: the
weights load exactly as the folder's, and an fp8 scaled transformer stays quantized and loads per stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffpipe_core.parts.ldm import vae_table
from diffpipe_core.quantize import ScaledLinear
from diffpipe_core.registry import Registry
from diffpipe_core.schema import ConfigError, validate
from diffpipe_core.testing.component_files import (
    assert_same_state,
    config_only,
    hub_snapshot,
    quantizable_linears,
    quantize_file,
    write_component_files,
)
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_flux.chroma import plugin as chroma
from diffpipe_flux.chroma_keys import layout_for_config
from diffpipe_flux.config import ChromaConfig

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def comfy(tiny_chroma: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny Chroma as ComfyUI component files and a config-only folder ``configs``."""
    out = tmp_path_factory.mktemp("comfy")
    config = json.loads((tiny_chroma / "transformer" / "config.json").read_text())
    vae = json.loads((tiny_chroma / "vae" / "config.json").read_text())
    files = write_component_files(tiny_chroma, out, layout_for_config(config), vae_table(vae, ""))
    files["configs"] = config_only(tiny_chroma, out / "configs")
    return files


def config(path: Path | None, **keys) -> ChromaConfig:
    table = {"type": "chroma", "path": path, "dtype": "float32", "encoder_dtype": "float32", "t5_max_length": 8}
    return validate(ChromaConfig, {k: v for k, v in {**table, **keys}.items() if v is not None}, "test")


def files_of(comfy: dict) -> dict:
    return {"diffusion_model": comfy["diffusion_model"], "vae": comfy["vae"], "text_encoders": comfy["text_encoders"]}


def test_component_files_load_exactly_the_folders_weights(tiny_chroma: Path, comfy: dict) -> None:
    cfg = config(comfy["configs"], **files_of(comfy))
    assert chroma.validate_model_files(cfg) == []
    lines = "\n".join(chroma.model_file_lines(cfg))
    assert "diffusion_model: " in lines and "Chroma layout" in lines
    assert f"vae: {comfy['vae']}: LDM layout" in lines
    assert f"text_encoder: {comfy['text_encoders'][0]}: diffusers," in lines and "(T5EncoderModel)" in lines
    folder = config(tiny_chroma)
    got, expected = chroma.load_encoders(cfg, CPU), chroma.load_encoders(folder, CPU)
    for name in ("vae", "text_encoder"):
        assert_same_state(getattr(got, name).state_dict(), getattr(expected, name).state_dict())
    for dtype in (torch.float32, torch.bfloat16):
        assert_same_state(
            chroma.load_diffusion_model(cfg, CPU, dtype).state_dict(),
            chroma.load_diffusion_model(folder, CPU, dtype).state_dict(),
        )


def test_configs_from_the_hugging_face_cache(tiny_chroma: Path, comfy: dict, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError, match=r"no snapshot of lodestones/Chroma1-HD .*hf download lodestones/Chroma1-HD"):
        config(None, **files_of(comfy))
    snapshot = hub_snapshot(tiny_chroma, tmp_path / "hub", "lodestones/Chroma1-HD")
    cfg = config(None, **files_of(comfy))
    assert cfg.path == snapshot and chroma.validate_model_files(cfg) == []


def test_a_quantized_transformer_stays_quantized(comfy: dict, tmp_path: Path) -> None:
    file = quantize_file(comfy["diffusion_model"], tmp_path / "chroma_fp8_scaled.safetensors", "fp8_scaled")
    cfg = config(comfy["configs"], **{**files_of(comfy), "diffusion_model": file})
    assert chroma.validate_model_files(cfg) == []
    model = chroma.load_diffusion_model(cfg, CPU, torch.bfloat16)
    kept = {n: m for n, m in model.named_modules() if isinstance(m, ScaledLinear)}
    plain = chroma.load_diffusion_model(config(comfy["configs"], **files_of(comfy)), CPU, torch.bfloat16)
    assert set(kept) == quantizable_linears(plain)  # q, k and v cut from their fused tensor each
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in kept.values())
    assert f"{len(kept)} linears kept quantized" in chroma.model_file_lines(cfg)[0]
    registry = Registry()
    assert registry.register_model("chroma", chroma).ok
    assert_stages_read_their_own(registry.model("chroma"), cfg)
