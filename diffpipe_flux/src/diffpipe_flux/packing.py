"""Flux's 2x2 latent packing (the core's :func:`~diffpipe_core.parts.latents.pack_2x2`) and its position ids."""

from __future__ import annotations

import torch

from diffpipe_core.parts.latents import pack_2x2 as pack
from diffpipe_core.parts.latents import unpack_2x2 as unpack

__all__ = ["image_ids", "pack", "text_ids", "unpack"]


def image_ids(h: int, w: int) -> torch.Tensor:
    """``(h/2 * w/2, 3)`` int64 ids ``[0, row, col]`` of the packed tokens (FluxPipeline._prepare_latent_image_ids)."""
    rows = torch.arange(h // 2).repeat_interleave(w // 2)
    cols = torch.arange(w // 2).repeat(h // 2)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=1)


def text_ids(n: int) -> torch.Tensor:
    """``(n, 3)`` zero ids of the text tokens."""
    return torch.zeros(n, 3, dtype=torch.long)
