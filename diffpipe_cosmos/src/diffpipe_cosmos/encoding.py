"""Caching-time encoders: the VAE (``AutoencoderKLCosmos`` for 1.0, ``AutoencoderKLWan`` for Predict2) with the
latent normalisation of each reference pipeline, and T5 with Cosmos' zero-padded 512-token embeddings."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from diffpipe_cosmos.config import CosmosConfigBase
from diffpipe_cosmos.original import Variant

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VAE_CLASSES = {"1.0": "AutoencoderKLCosmos", "predict2": "AutoencoderKLWan"}
log = logging.getLogger("diffpipe.cosmos")

# (frames, height, width) the released checkpoints were trained on; anything else is allowed, with a warning.
_SIZES_720P = {(704, 1280), (1280, 704), (960, 960), (704, 960), (960, 704)}
TRAINED_FRAMES = {"1.0": (121,), "predict2": (1, 93)}
TRAINED_SIZES = {"1.0": _SIZES_720P, "predict2": _SIZES_720P | {(1024, 1024), (768, 1360), (1360, 768)}}


@dataclass
class CosmosEncoders:
    variant: Variant
    vae: Any
    t5: Any
    tokenizer: Any
    t5_max_length: int
    sigma_data: float
    device: torch.device
    dtype: torch.dtype
    warned: set[tuple[int, ...]] = field(default_factory=set)


def _subfolder(cfg: CosmosConfigBase, name: str) -> Path:
    folder = cfg.path / name
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: missing; [model] path must be a diffusers Cosmos folder with {name}/")
    return folder


def load_encoders(cfg: CosmosConfigBase, variant: Variant, sigma_data: float, device: torch.device) -> CosmosEncoders:
    """VAE, T5 encoder and tokenizer from the diffusers folder."""
    import diffusers
    from transformers import AutoTokenizer, T5EncoderModel

    dtype = DTYPES[cfg.encoder_dtype]
    kw = {"torch_dtype": dtype, "local_files_only": True}
    vae = getattr(diffusers, VAE_CLASSES[variant]).from_pretrained(str(_subfolder(cfg, "vae")), **kw)
    t5 = T5EncoderModel.from_pretrained(str(_subfolder(cfg, "text_encoder")), **kw)
    tokenizer = AutoTokenizer.from_pretrained(str(_subfolder(cfg, "tokenizer")), local_files_only=True)
    for m in (vae, t5):
        m.to(device).eval().requires_grad_(False)
    return CosmosEncoders(variant, vae, t5, tokenizer, cfg.t5_max_length, sigma_data, device, dtype)


def _stats(values: list[float], channels: int, frames: int, vae_dir: str) -> torch.Tensor:
    """Latent statistics shaped ``(1, C, T, 1, 1)``: per channel (Wan) or per channel and latent frame
    (Cosmos-1.0's VAE holds C x 16 values), as the pipelines index them."""
    stats = torch.tensor(values, dtype=torch.float32).view(1, channels, -1, 1, 1)
    if stats.shape[2] == 1:
        return stats
    if stats.shape[2] < frames:
        raise ValueError(
            f"{vae_dir}: latents_mean/latents_std hold statistics for {stats.shape[2]} latent frames; this clip has "
            f"{frames} (use fewer frames)"
        )
    return stats[:, :, :frames]


def warn_untrained_size(enc: CosmosEncoders, frames: int, height: int, width: int) -> None:
    """Log once per shape when (frames, height, width) is not what the released checkpoints were trained on."""
    key = (frames, height, width)
    if key in enc.warned:
        return
    enc.warned.add(key)
    if frames not in TRAINED_FRAMES[enc.variant] or (height, width) not in TRAINED_SIZES[enc.variant]:
        sizes = ", ".join(f"{w}x{h}" for h, w in sorted(TRAINED_SIZES[enc.variant]))
        log.warning(
            "Cosmos %s: training on %d frames at %dx%d; the released checkpoints were trained on %s frames at %s "
            "(other sizes work, the model may need more steps to adapt)",
            enc.variant,
            frames,
            width,
            height,
            " or ".join(map(str, TRAINED_FRAMES[enc.variant])),
            sizes,
        )


@torch.no_grad()
def encode_pixels(enc: CosmosEncoders, pixels: torch.Tensor) -> torch.Tensor:
    """``(B, 3, H, W)`` images or ``(B, 3, F, H, W)`` videos -> normalised latents ``(B, C, T, h, w)``, float32.

    The posterior's mode is cached (deterministic). Normalisation, inverting the pipelines' decode step:
    ``(z - mean) * sigma_data / std`` with the VAE's ``latents_mean``/``latents_std`` (1.0: sigma_data 0.5,
    ``z * sigma_data`` when the VAE has no statistics; Predict2: the Wan statistics and sigma_data 1).
    """
    video = pixels if pixels.dim() == 5 else pixels.unsqueeze(2)
    warn_untrained_size(enc, video.shape[2], video.shape[3], video.shape[4])
    z = enc.vae.encode(video.to(enc.device, enc.dtype)).latent_dist.mode().float()
    cfg = enc.vae.config
    if cfg.latents_mean is None or cfg.latents_std is None:
        return (z * enc.sigma_data).cpu()
    where = str(getattr(cfg, "_name_or_path", "vae"))
    c, t = z.shape[1], z.shape[2]
    mean = _stats(list(cfg.latents_mean), c, t, where).to(z.device)
    std = _stats(list(cfg.latents_std), c, t, where).to(z.device)
    return ((z - mean) * enc.sigma_data / std).cpu()


def downsample_mask(mask: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
    """A ``(B, 1, H, W)`` pixel mask averaged down to the latent grid, ``(B, 1, 1, h, w)`` (one for every frame)."""
    return F.adaptive_avg_pool2d(mask.float(), latent_hw).unsqueeze(2)


@torch.no_grad()
def encode_captions(enc: CosmosEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
    """``t5_embeds`` (B, t5_max_length, d): T5's last hidden state with the padding positions set to zero,
    exactly as the Cosmos pipelines' ``_get_t5_prompt_embeds`` (the transformer attends to all positions)."""
    tokens = enc.tokenizer(
        captions, padding="max_length", max_length=enc.t5_max_length, truncation=True, return_tensors="pt"
    )
    mask = tokens.attention_mask.bool().to(enc.device)
    embeds = enc.t5(tokens.input_ids.to(enc.device), attention_mask=mask).last_hidden_state.float()
    embeds = embeds * mask.unsqueeze(-1)
    return {"t5_embeds": embeds.cpu()}
