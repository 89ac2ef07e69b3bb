"""Caching-time latents: the VAE posterior's mode with the model's own normalisation, and loss masks on the latent
grid. The mode (not a sample) is cached, so a cache is deterministic."""

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
