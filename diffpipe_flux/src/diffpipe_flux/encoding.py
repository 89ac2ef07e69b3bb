"""Caching-time encoders: the Flux VAE (with its shift and scaling) and the two text encoders."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from diffpipe_flux.config import FluxConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class FluxEncoders:
    vae: Any
    clip: Any
    clip_tokenizer: Any
    t5: Any
    t5_tokenizer: Any
    t5_max_length: int
    device: torch.device
    dtype: torch.dtype


def _subfolder(cfg: FluxConfig, name: str) -> Path:
    folder = cfg.path / name
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: missing; [model] path must be a diffusers Flux folder with {name}/")
    return folder


def load_encoders(cfg: FluxConfig, device: torch.device) -> FluxEncoders:
    """VAE, CLIP text encoder (pooled vector) and T5 encoder (sequence) with their tokenizers."""
    from diffusers import AutoencoderKL
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    dtype = DTYPES[cfg.encoder_dtype]
    kw = {"torch_dtype": dtype, "local_files_only": True}
    vae = AutoencoderKL.from_pretrained(str(_subfolder(cfg, "vae")), **kw)
    clip = CLIPTextModel.from_pretrained(str(_subfolder(cfg, "text_encoder")), **kw)
    t5 = T5EncoderModel.from_pretrained(str(_subfolder(cfg, "text_encoder_2")), **kw)
    clip_tok = AutoTokenizer.from_pretrained(str(_subfolder(cfg, "tokenizer")), local_files_only=True)
    t5_tok = AutoTokenizer.from_pretrained(str(_subfolder(cfg, "tokenizer_2")), local_files_only=True)
    for m in (vae, clip, t5):
        m.to(device).eval().requires_grad_(False)
    return FluxEncoders(vae, clip, clip_tok, t5, t5_tok, cfg.t5_max_length, device, dtype)


def vae_factor(vae: Any) -> int:
    return 2 ** (len(vae.config.block_out_channels) - 1)


@torch.no_grad()
def encode_pixels(enc: FluxEncoders, pixels: torch.Tensor) -> torch.Tensor:
    """Latents as the Flux transformer sees them: ``(mode - shift_factor) * scaling_factor``, float32.

    The posterior's mode (not a sample) is cached, so the cache is deterministic."""
    latents = enc.vae.encode(pixels.to(enc.device, enc.dtype)).latent_dist.mode()
    shift = enc.vae.config.shift_factor or 0.0
    return ((latents.float() - shift) * enc.vae.config.scaling_factor).cpu()


def downsample_mask(mask: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
    """A ``(B, 1, H, W)`` pixel mask averaged down to the latent grid."""
    return F.adaptive_avg_pool2d(mask.float(), latent_hw)


@torch.no_grad()
def encode_captions(enc: FluxEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
    """``t5_embeds`` (B, t5_max_length, d) and ``clip_pooled`` (B, d), as FluxPipeline.encode_prompt makes them."""
    clip_len = min(enc.clip_tokenizer.model_max_length, enc.clip.config.max_position_embeddings)
    clip_ids = enc.clip_tokenizer(
        captions, padding="max_length", max_length=clip_len, truncation=True, return_tensors="pt"
    ).input_ids
    pooled = enc.clip(clip_ids.to(enc.device), output_hidden_states=False).pooler_output
    t5_ids = enc.t5_tokenizer(
        captions, padding="max_length", max_length=enc.t5_max_length, truncation=True, return_tensors="pt"
    ).input_ids
    embeds = enc.t5(t5_ids.to(enc.device), output_hidden_states=False)[0]
    return {"t5_embeds": embeds.float().cpu(), "clip_pooled": pooled.float().cpu()}
