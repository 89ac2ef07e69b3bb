"""Flux's 2x2 latent packing (the core's :func:`~diffpipe_core.parts.latents.pack_2x2`) and its position ids."""

from __future__ import annotations

import torch

from diffpipe_core.parts.latents import pack_2x2 as pack
from diffpipe_core.parts.latents import unpack_2x2 as unpack

__all__ = ["image_ids", "pack", "text_ids", "unpack"]


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
