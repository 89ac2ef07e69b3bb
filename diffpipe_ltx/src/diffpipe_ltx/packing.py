"""LTX latents: the video VAE's normalised latents (LTX-Video and LTX-2), and LTX-Video's token layout: latents
``(B, C, F, H, W)`` <-> tokens ``(B, F*H*W, C)`` (patch sizes 1, as in every released LTX-Video transformer), in
``LTXPipeline._pack_latents``' order (frame, row, column)."""

from __future__ import annotations

import torch


def pack(latents: torch.Tensor, patch_size: int = 1, patch_size_t: int = 1) -> torch.Tensor:
    """``(B, C, F, H, W)`` -> ``(B, F/pt * H/p * W/p, C*pt*p*p)``, as ``LTXPipeline._pack_latents``."""
    b, c, f, h, w = latents.shape
    x = latents.reshape(b, c, f // patch_size_t, patch_size_t, h // patch_size, patch_size, w // patch_size, patch_size)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)


def unpack(tokens: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack` (patch sizes 1) for a latent grid of ``frames x height x width``."""
    b, _, c = tokens.shape
    return tokens.reshape(b, frames, height, width, c).permute(0, 4, 1, 2, 3)


def encode_latents(vae, pixels: torch.Tensor, scale: bool = True) -> torch.Tensor:
    """Pixels ``(B, 3, F, H, W)`` through the LTX video VAE (the posterior's mode), normalised with its latent
    statistics as the pipelines normalise them: ``(z - mean) * scaling_factor / std``, or without the scaling factor
    (``scale=False``: how LTX-2's image-to-video pipeline normalises its first frame). On the CPU."""
    from diffpipe_core.parts.latents import normalize, vae_mode

    z = vae_mode(vae, pixels, video=True)
    return normalize(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor if scale else 1.0).cpu()
