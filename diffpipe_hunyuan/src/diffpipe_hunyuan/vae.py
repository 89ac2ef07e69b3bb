"""The HunyuanVideo VAE's memory options while caching: spatial tiling, temporal chunks, slicing."""

from __future__ import annotations

from typing import Any

from diffpipe_hunyuan.config import HunyuanConfig


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
