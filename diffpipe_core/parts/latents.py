"""Caching-time latents: the VAE posterior's mode with the model's own normalisation, and loss masks on the latent
grid. The mode (not a sample) is cached, so a cache is deterministic. Also the 2x2 token packing of the MMDiT image
models (Flux, Qwen-Image)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


@torch.no_grad()
def vae_mode(vae: Any, pixels: torch.Tensor, video: bool = False) -> torch.Tensor:
    """The posterior mode of ``pixels`` in float32, on the VAE's device. ``video``: a video VAE, which takes
    ``(B, 3, F, H, W)``; images ``(B, 3, H, W)`` are given one frame."""
    if video and pixels.dim() == 4:
        pixels = pixels.unsqueeze(2)
    param = next(vae.parameters())
    return vae.encode(pixels.to(param.device, param.dtype)).latent_dist.mode().float()


def shift_and_scale(z: torch.Tensor, vae_config: Any) -> torch.Tensor:
    """``(z - shift_factor) * scaling_factor`` (``shift_factor`` None counts as 0), as Flux and SD pipelines
    invert it before decoding."""
    shift = getattr(vae_config, "shift_factor", None) or 0.0
    return (z - shift) * vae_config.scaling_factor


def per_channel(values: Any, like: torch.Tensor) -> torch.Tensor:
    """Latent statistics shaped to broadcast over ``like`` (channels at dim 1): one value per channel, or for video
    latents ``(B, C, T, h, w)`` one per channel and latent frame (``C x N`` values, ``N >= T``, channel-major: the
    Cosmos-1.0 VAE's), of which the first ``T`` frames are used; a single number applies to every channel."""
    stats = torch.as_tensor(values, dtype=like.dtype, device=like.device)
    channels = like.shape[1]
    if stats.numel() in (1, channels) or like.dim() != 5:
        return stats.view(1, -1, *([1] * (like.dim() - 2)))
    frames = stats.view(1, channels, -1, 1, 1)
    if frames.shape[2] < like.shape[2]:
        raise ValueError(
            f"latents_mean/latents_std hold statistics for {frames.shape[2]} latent frames; these latents have "
            f"{like.shape[2]} (use fewer frames)"
        )
    return frames[:, :, : like.shape[2]]


def normalize(z: torch.Tensor, mean: Any, std: Any, scale: float = 1.0) -> torch.Tensor:
    """``(z - mean) * scale / std`` (:func:`per_channel` statistics): the inverse of :func:`denormalize`."""
    return (z - per_channel(mean, z)) * scale / per_channel(std, z)


def denormalize(z: torch.Tensor, mean: Any, std: Any, scale: float = 1.0) -> torch.Tensor:
    """``z * std / scale + mean`` (:func:`per_channel` statistics), as the pipelines undo the normalisation before
    decoding."""
    return z * per_channel(std, z) / scale + per_channel(mean, z)


def latent_mask(masks: torch.Tensor, latent_hw: tuple[int, ...], video: bool = False) -> torch.Tensor:
    """``(B, 1, H, W)`` pixel loss masks averaged down to the latent grid: ``(B, 1, h, w)``, or for a video model
    ``(B, 1, 1, h, w)`` (one mask for every latent frame)."""
    mask = F.adaptive_avg_pool2d(masks.float(), tuple(latent_hw[-2:]))
    return mask.unsqueeze(2) if video else mask


def image_vae_latents(vae: Any, pixels: torch.Tensor, masks: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Images through an image VAE normalised by ``shift_factor`` and ``scaling_factor`` (``AutoencoderKL``: SD3's,
    FLUX.1's): ``latents`` ``(B, C, h, w)`` = ``(mode - shift_factor) * scaling_factor`` as the pipelines normalise
    them, and ``mask`` on the latent grid when ``masks`` are given; on the CPU, for the cache."""
    out = {"latents": shift_and_scale(vae_mode(vae, pixels), vae.config).cpu()}
    if masks is not None:
        out["mask"] = latent_mask(masks, out["latents"].shape)
    return out


def frame_vae_latents(vae: Any, pixels: torch.Tensor, masks: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Images through a video VAE normalised per channel (Qwen-Image's ``AutoencoderKLQwenImage``, used by
    Qwen-Image and Krea 2), each image one frame: ``latents`` ``(B, C, h, w)`` = ``(z - latents_mean) /
    latents_std`` as the pipelines normalise them, and ``mask`` on the latent grid when ``masks`` are given; on the
    CPU, for the cache."""
    z = vae_mode(vae, pixels, video=True)
    out = {"latents": normalize(z, vae.config.latents_mean, vae.config.latents_std)[:, :, 0].cpu()}
    if masks is not None:
        out["mask"] = latent_mask(masks, out["latents"].shape)
    return out


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W)`` -> ``(B, H/2 * W/2, 4C)``: 2x2 latent patches as tokens, row by row, in the layout of
    ``FluxPipeline._pack_latents`` and ``QwenImagePipeline._pack_latents``."""
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"latents need an even height and width to be packed 2x2, got {h}x{w}")
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`pack_2x2` for latents of size ``h x w``."""
    b, _, d = tokens.shape
    c = d // 4
    x = tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)
