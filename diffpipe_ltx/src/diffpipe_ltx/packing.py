"""LTX-Video's token layout: latents ``(B, C, F, H, W)`` <-> tokens ``(B, F*H*W, C)`` (patch sizes 1, as in every
released LTX-Video transformer), in ``LTXPipeline._pack_latents``' order (frame, row, column)."""

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
