"""Caching-time encoders: the LTX-Video VAE (latents normalised like LTXPipeline's) and T5 with its mask."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from diffpipe_ltx.config import LTXConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LTXEncoders:
    vae: Any
    t5: Any
    tokenizer: Any
    t5_max_length: int
    device: torch.device
    dtype: torch.dtype


def _subfolder(cfg: LTXConfig, name: str) -> Path:
    folder = cfg.path / name
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: missing; [model] path must be a diffusers LTX-Video folder with {name}/")
    return folder


def load_encoders(cfg: LTXConfig, device: torch.device) -> LTXEncoders:
    """``AutoencoderKLLTXVideo``, the T5 encoder and its tokenizer, from the folder."""
    from diffusers import AutoencoderKLLTXVideo
    from transformers import AutoTokenizer, T5EncoderModel

    dtype = DTYPES[cfg.encoder_dtype]
    kw = {"torch_dtype": dtype, "local_files_only": True}
    vae = AutoencoderKLLTXVideo.from_pretrained(str(_subfolder(cfg, "vae")), **kw)
    t5 = T5EncoderModel.from_pretrained(str(_subfolder(cfg, "text_encoder")), **kw)
    tokenizer = AutoTokenizer.from_pretrained(str(_subfolder(cfg, "tokenizer")), local_files_only=True)
    for m in (vae, t5):
        m.to(device).eval().requires_grad_(False)
    return LTXEncoders(vae, t5, tokenizer, cfg.t5_max_length, device, dtype)


def normalize_latents(latents: torch.Tensor, vae: Any) -> torch.Tensor:
    """``(z - latents_mean) * scaling_factor / latents_std`` per channel of ``(B, C, F, H, W)``: the inverse of
    ``LTXPipeline._denormalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)``."""
    mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
    std = vae.latents_std.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
    return (latents - mean) * vae.config.scaling_factor / std


@torch.no_grad()
def encode_pixels(enc: LTXEncoders, pixels: torch.Tensor) -> torch.Tensor:
    """Normalised latents ``(B, C, F', H/32, W/32)`` in float32 of images ``(B, 3, H, W)`` (one frame) or videos
    ``(B, 3, F, H, W)`` with ``F = 8n + 1`` (``F' = n + 1``). The posterior's mode is cached (deterministic)."""
    if pixels.dim() == 4:
        pixels = pixels.unsqueeze(2)
    latents = enc.vae.encode(pixels.to(enc.device, enc.dtype)).latent_dist.mode()
    return normalize_latents(latents.float(), enc.vae).cpu()


def downsample_mask(mask: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
    """A ``(B, 1, H, W)`` pixel loss mask averaged down to the latent grid ``(B, 1, h, w)`` (all frames share it)."""
    return F.adaptive_avg_pool2d(mask.float(), latent_hw)


@torch.no_grad()
def encode_captions(enc: LTXEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
    """``t5_embeds`` (B, t5_max_length, d) and ``t5_mask`` (B, t5_max_length) bool, as
    ``LTXPipeline.encode_prompt`` makes them (T5 runs without the mask; the transformer's cross-attention uses it)."""
    tokens = enc.tokenizer(
        captions,
        padding="max_length",
        max_length=enc.t5_max_length,
        truncation=True,
        add_special_tokens=True,
        return_tensors="pt",
    )
    embeds = enc.t5(tokens.input_ids.to(enc.device))[0]
    return {"t5_embeds": embeds.float().cpu(), "t5_mask": tokens.attention_mask.bool()}
