"""Caching-time encoders: the HunyuanVideo VAE (4x temporal, 8x spatial) and the Llama + CLIP-L text encoders.

Text goes through diffusers' own ``HunyuanVideoPipeline.encode_prompt`` (built from the two encoders alone),
so the prompt template, its token crop, the hidden layer (the third from last) and the attention mask are
exactly the pipeline's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from diffpipe_hunyuan.config import HunyuanConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class HunyuanEncoders:
    vae: Any
    text_pipeline: Any  # a HunyuanVideoPipeline holding only the text encoders and tokenizers
    prompt_template: dict[str, Any]
    max_length: int
    device: torch.device
    dtype: torch.dtype


def subfolder(cfg: HunyuanConfig, name: str) -> Path:
    folder = cfg.path / name
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: missing; [model] path must be a diffusers HunyuanVideo folder with {name}/")
    return folder


def prompt_template(cfg: HunyuanConfig) -> dict[str, Any]:
    """diffusers' HunyuanVideo prompt template with the configured crop."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    return {**DEFAULT_PROMPT_TEMPLATE, "crop_start": cfg.text_crop_start}


def configure_vae(vae: Any, cfg: HunyuanConfig) -> Any:
    """Tiling (spatial tiles of ``vae_tile_size`` pixels, overlapping by a quarter), the temporal chunk length
    and slicing, as the config asks. Strides stay multiples of the VAE's compression (8 pixels, 4 frames): the
    VAE's temporal tiling drops latent frames otherwise."""
    vae.tile_sample_min_num_frames = cfg.vae_tile_frames
    vae.tile_sample_stride_num_frames = max(4, cfg.vae_tile_frames * 3 // 16 * 4)
    if cfg.vae_tiling:
        size, stride = cfg.vae_tile_size, cfg.vae_tile_size * 3 // 4
        vae.enable_tiling(
            tile_sample_min_height=size,
            tile_sample_min_width=size,
            tile_sample_stride_height=stride,
            tile_sample_stride_width=stride,
        )
    if cfg.vae_slicing:
        vae.enable_slicing()
    return vae


def load_encoders(cfg: HunyuanConfig, device: torch.device) -> HunyuanEncoders:
    """The VAE and both text encoders with their tokenizers, from the diffusers folder."""
    from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoPipeline
    from transformers import AutoTokenizer, CLIPTextModel, LlamaModel

    dtype = DTYPES[cfg.encoder_dtype]
    kw = {"torch_dtype": dtype, "local_files_only": True}
    vae = AutoencoderKLHunyuanVideo.from_pretrained(str(subfolder(cfg, "vae")), **kw)
    llama = LlamaModel.from_pretrained(str(subfolder(cfg, "text_encoder")), **kw)
    clip = CLIPTextModel.from_pretrained(str(subfolder(cfg, "text_encoder_2")), **kw)
    llama_tok = AutoTokenizer.from_pretrained(str(subfolder(cfg, "tokenizer")), local_files_only=True)
    clip_tok = AutoTokenizer.from_pretrained(str(subfolder(cfg, "tokenizer_2")), local_files_only=True)
    for m in (vae, llama, clip):
        m.to(device).eval().requires_grad_(False)
    text = HunyuanVideoPipeline(
        text_encoder=llama,
        tokenizer=llama_tok,
        transformer=None,
        vae=None,
        scheduler=None,
        text_encoder_2=clip,
        tokenizer_2=clip_tok,
    )
    return HunyuanEncoders(configure_vae(vae, cfg), text, prompt_template(cfg), cfg.text_max_length, device, dtype)


@torch.no_grad()
def encode_pixels(enc: HunyuanEncoders, pixels: torch.Tensor) -> torch.Tensor:
    """``(B, C, F, H, W)`` videos (or ``(B, C, H, W)`` images, encoded as 1-frame videos) to latents
    ``(B, C', (F-1)/4+1, H/8, W/8)``: the posterior's mode times the VAE's ``scaling_factor``, float32.
    The mode (not a sample) is cached, so the cache is deterministic."""
    if pixels.dim() == 4:
        pixels = pixels.unsqueeze(2)
    latents = enc.vae.encode(pixels.to(enc.device, enc.dtype)).latent_dist.mode()
    return (latents.float() * enc.vae.config.scaling_factor).cpu()


def latent_mask(mask: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
    """A ``(B, 1, H, W)`` pixel mask averaged down to the latent grid, ``(B, 1, 1, h, w)``: the same for every
    latent frame."""
    return F.adaptive_avg_pool2d(mask.float(), latent_hw).unsqueeze(2).cpu()


@torch.no_grad()
def encode_captions(enc: HunyuanEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
    """``text_embeds`` (B, text_max_length, d), ``text_mask`` (B, text_max_length) and ``clip_pooled`` (B, d),
    from ``HunyuanVideoPipeline.encode_prompt``."""
    embeds, pooled, mask = enc.text_pipeline.encode_prompt(
        captions,
        prompt_template=enc.prompt_template,
        device=enc.device,
        dtype=enc.dtype,
        max_sequence_length=enc.max_length,
    )
    return {"text_embeds": embeds.float().cpu(), "text_mask": mask.long().cpu(), "clip_pooled": pooled.float().cpu()}
