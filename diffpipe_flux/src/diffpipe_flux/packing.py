"""Flux's 2x2 latent packing and its position ids."""

from __future__ import annotations

import torch


def pack(latents: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W)`` -> ``(B, H/2 * W/2, 4C)``, the token layout of FluxPipeline._pack_latents."""
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"Flux latents need even height and width, got {h}x{w}")
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`pack` for latents of size ``h x w``."""
    b, _, d = tokens.shape
    c = d // 4
    x = tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def grid_ids(rows: int, cols: int, first: int = 0, axes: int = 3) -> torch.Tensor:
    """``(rows * cols, axes)`` int64 ids ``[first, row, col, 0, ...]`` of a token grid in row-major order."""
    r = torch.arange(rows).repeat_interleave(cols)
    c = torch.arange(cols).repeat(rows)
    extra = [torch.zeros_like(r)] * (axes - 3)
    return torch.stack([torch.full_like(r, first), r, c, *extra], dim=1)


def image_ids(h: int, w: int) -> torch.Tensor:
    """``(h/2 * w/2, 3)`` int64 ids ``[0, row, col]`` of the packed tokens (FluxPipeline._prepare_latent_image_ids)."""
    return grid_ids(h // 2, w // 2)


def text_ids(n: int) -> torch.Tensor:
    """``(n, 3)`` zero ids of the text tokens."""
    return torch.zeros(n, 3, dtype=torch.long)
