"""Flux's 2x2 latent packing and its position ids; FLUX.2's 2x2 latent patches (the same channel order, kept on a
grid), its tokens and its four-axis position ids."""

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


# ---------------------------------------------------------------------------------------------- FLUX.2
def patchify(latents: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W)`` -> ``(B, 4C, H/2, W/2)`` (Flux2Pipeline._patchify_latents): Flux's packed channels on the grid."""
    b, c, h, w = latents.shape
    return pack(latents).transpose(1, 2).reshape(b, 4 * c, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`patchify` (Flux2Pipeline._unpatchify_latents)."""
    b, c, h, w = latents.shape
    return unpack(latents.flatten(2).transpose(1, 2), 2 * h, 2 * w)


def tokens(latents: torch.Tensor) -> torch.Tensor:
    """``(B, C, h, w)`` -> ``(B, h * w, C)`` (Flux2Pipeline._pack_latents)."""
    return latents.flatten(2).transpose(1, 2)


def untokens(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`tokens` for an ``h x w`` grid."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], h, w)


def flux2_image_ids(h: int, w: int, first: int = 0) -> torch.Tensor:
    """``(h * w, 4)`` ids ``[first, row, col, 0]`` of an ``h x w`` FLUX.2 latent grid (first: 0 for the target, 10 * k
    for reference image k = 1, 2, ..., as Flux2Pipeline._prepare_latent_ids / _prepare_image_ids)."""
    return grid_ids(h, w, first, axes=4)


def flux2_text_ids(n: int) -> torch.Tensor:
    """``(n, 4)`` ids ``[0, 0, 0, position]`` of the text tokens (Flux2Pipeline._prepare_text_ids)."""
    ids = torch.zeros(n, 4, dtype=torch.long)
    ids[:, 3] = torch.arange(n)
    return ids
