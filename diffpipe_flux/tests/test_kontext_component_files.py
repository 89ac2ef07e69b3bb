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

from diffpipe_core.quantize import ScaledLinear
from diffpipe_core.registry import Registry
from diffpipe_core.schema import ConfigError, validate
from diffpipe_core.testing.component_files import assert_same_state, hub_snapshot, quantizable_linears, quantize_file
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_flux.config import FluxKontextConfig
from diffpipe_flux.kontext import plugin as kontext

CPU = torch.device("cpu")
REPO = "black-forest-labs/FLUX.1-Kontext-dev"


@pytest.fixture(scope="module")
def comfy(tiny_flux: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return comfy_files(tiny_flux, tmp_path_factory.mktemp("comfy"))


def config(path: Path | None, **keys) -> FluxKontextConfig:
    table = {"type": "flux-kontext", "path": path, "dtype": "float32", "encoder_dtype": "float32", "t5_max_length": 8}
    return validate(FluxKontextConfig, {k: v for k, v in {**table, **keys}.items() if v is not None}, "test")


def files_of(comfy: dict) -> dict:
    """The files in the order a user might list them (T5 first): which encoder each holds is read from its tensors."""
    return {
        "diffusion_model": comfy["diffusion_model"],
        "vae": comfy["vae"],
        "text_encoders": comfy["text_encoders"][::-1],
    }


def test_component_files_load_exactly_the_folders_weights(tiny_flux: Path, comfy: dict) -> None:
    cfg = config(comfy["configs"], **files_of(comfy))
    assert kontext.validate_model_files(cfg) == []
    lines = "\n".join(kontext.model_file_lines(cfg))
    assert "diffusion_model: " in lines and "BFL layout" in lines and f"vae: {comfy['vae']}: LDM layout" in lines
    assert "(CLIPTextModel)" in lines and "(T5EncoderModel)" in lines
    folder = config(tiny_flux)
    got, expected = kontext.load_encoders(cfg, CPU), kontext.load_encoders(folder, CPU)
    for name in ("vae", "text_encoder", "text_encoder_2"):
        assert_same_state(getattr(got, name).state_dict(), getattr(expected, name).state_dict())
    for dtype in (torch.float32, torch.bfloat16):
        assert_same_state(
            kontext.load_diffusion_model(cfg, CPU, dtype).state_dict(),
            kontext.load_diffusion_model(folder, CPU, dtype).state_dict(),
        )


def test_configs_from_the_hugging_face_cache(tiny_flux: Path, comfy: dict, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError, match=rf"no snapshot of {REPO} .*hf download {REPO}"):
        config(None, **files_of(comfy))
    snapshot = hub_snapshot(tiny_flux, tmp_path / "hub", REPO)
    cfg = config(None, **files_of(comfy))
    assert cfg.path == snapshot and kontext.validate_model_files(cfg) == []


def test_a_quantized_transformer_stays_quantized(comfy: dict, tmp_path: Path) -> None:
    file = quantize_file(comfy["diffusion_model"], tmp_path / "flux1-kontext-dev_fp8_scaled.safetensors", "fp8_scaled")
    cfg = config(comfy["configs"], **{**files_of(comfy), "diffusion_model": file})
    assert kontext.validate_model_files(cfg) == []
    model = kontext.load_diffusion_model(cfg, CPU, torch.bfloat16)
    kept = {n: m for n, m in model.named_modules() if isinstance(m, ScaledLinear)}
    plain = kontext.load_diffusion_model(config(comfy["configs"], **files_of(comfy)), CPU, torch.bfloat16)
    assert set(kept) == quantizable_linears(plain)  # q, k and v cut from their fused tensor each
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in kept.values())
    assert f"{len(kept)} linears kept quantized" in kontext.model_file_lines(cfg)[0]
    registry = Registry()
    assert registry.register_model("flux-kontext", kontext).ok
    assert_stages_read_their_own(registry.model("flux-kontext"), cfg)
