"""A torch-only stand-in for the one torchvision call in diffusers' Cosmos transformer.

``CosmosTransformer3DModel.forward`` resizes its padding mask with
``torchvision.transforms.functional.resize(mask, size, interpolation=NEAREST)``; for tensors torchvision
does that with ``torch.nn.functional.interpolate(mode="nearest")``. torchvision is not a dependency
(its wheels do not import beside every torch build), so the pipeline layers call :func:`resize_nearest`
directly, and :func:`install` lets the unmodified diffusers forward run without torchvision (tests and
inference scripts call it before ``transformer(...)``).
"""

from __future__ import annotations

import enum
from types import SimpleNamespace

import torch
import torch.nn.functional as F


def resize_nearest(mask: torch.Tensor, size: list[int] | tuple[int, int]) -> torch.Tensor:
    """``(..., H, W)`` -> ``(..., size[0], size[1])`` by nearest neighbour, like torchvision's NEAREST resize."""
    lead = mask.shape[:-2]
    flat = mask.reshape(-1, 1, *mask.shape[-2:])
    dtype = flat.dtype
    out = F.interpolate(flat.float() if not flat.is_floating_point() else flat, size=list(size), mode="nearest")
    return out.to(dtype).reshape(*lead, *out.shape[-2:])


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"


def _resize(img: torch.Tensor, size: list[int], interpolation: InterpolationMode = InterpolationMode.NEAREST, **_):
    if interpolation is not InterpolationMode.NEAREST:
        raise NotImplementedError(f"diffpipe_cosmos.resize handles NEAREST only, got {interpolation}")
    return resize_nearest(img, size)


transforms = SimpleNamespace(functional=SimpleNamespace(resize=_resize), InterpolationMode=InterpolationMode)


def install() -> None:
    """Give diffusers' Cosmos transformer module this resize when torchvision is missing (a no-op otherwise)."""
    import diffusers.models.transformers.transformer_cosmos as module

    if "transforms" not in vars(module):
        module.transforms = transforms
