"""``validate_model_files`` for SDXL: the folder or single file's structure, checked without reading weights."""

from __future__ import annotations

from pathlib import Path

from diffpipe_core.model_files import TOKENIZER, check_component, check_diffusers_folder, safetensors_keys
from diffpipe_sdxl.config import SDXLConfig

# SSD-1B and Segmind Vega ship as StableDiffusionXLPipeline folders too.
PIPELINES = ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLInpaintPipeline")
COMPONENTS = {
    "unet": ("UNet2DConditionModel",),
    "vae": ("AutoencoderKL",),
    "text_encoder": ("CLIPTextModel",),
    "text_encoder_2": ("CLIPTextModelWithProjection",),
    "tokenizer": (TOKENIZER,),
    "tokenizer_2": (TOKENIZER,),
}
UNET_PREFIX = "model.diffusion_model."  # as in sgm_layout, which imports torch


def problems(cfg: SDXLConfig) -> list[str]:
    """Problems with ``path`` (folder or single file), ``config_path`` and ``vae_path``."""
    found: list[str] = []
    if cfg.path.is_file():
        keys, problem = safetensors_keys(cfg.path)
        if problem:
            found.append(f"{problem}; expected an SDXL single-file checkpoint")
        elif not any(k.startswith(UNET_PREFIX) for k in keys):
            found.append(
                f"{cfg.path}: no UNet tensors (keys starting with {UNET_PREFIX!r}) among its {len(keys)} keys "
                f"(e.g. {', '.join(keys[:3])}); expected an SDXL single-file checkpoint"
            )
        if cfg.config_path is not None:
            found += check_diffusers_folder(cfg.config_path, PIPELINES, COMPONENTS, "sdxl")
    else:
        found += check_diffusers_folder(cfg.path, PIPELINES, COMPONENTS, "sdxl")
        if not found:
            found += _unet_weights(cfg.path / "unet")
    if cfg.vae_path is not None:
        found += check_component(Path(cfg.vae_path), ("AutoencoderKL",), "VAE (vae_path)")
    return found


def _unet_weights(unet: Path) -> list[str]:
    for stem in ("diffusion_pytorch_model", "diffusion_pytorch_model.fp16"):
        if (unet / f"{stem}.safetensors").is_file() or (unet / f"{stem}.safetensors.index.json").is_file():
            return []
    return [f"{unet}: no diffusion_pytorch_model[.fp16].safetensors (or .index.json); expected the UNet's weights "
            "(only safetensors are read)"]
