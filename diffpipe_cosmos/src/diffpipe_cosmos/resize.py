"""A torch-only stand-in for the one torchvision call in diffusers' Cosmos transformer, for running its unmodified
forward (inference scripts, the tests) where torchvision is not installed (its wheels do not import beside every
torch build). ``CosmosTransformer3DModel.forward`` resizes its padding mask with
``torchvision.transforms.functional.resize(mask, size, interpolation=NEAREST)``, which for tensors is
``torch.nn.functional.interpolate(mode="nearest")``. The pipeline layers need none of it (their mask is zeros)."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import torch
import torch.nn.functional as F


def resize_nearest(mask: torch.Tensor, size: list[int] | tuple[int, int]) -> torch.Tensor:
    """``(..., H, W)`` -> ``(..., size[0], size[1])`` by nearest neighbour, like torchvision's NEAREST resize."""
    flat = mask.reshape(-1, 1, *mask.shape[-2:])
    out = F.interpolate(flat if flat.is_floating_point() else flat.float(), size=list(size), mode="nearest")
    return out.to(mask.dtype).reshape(*mask.shape[:-2], *out.shape[-2:])


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"


def _resize(img: torch.Tensor, size: list[int], interpolation: InterpolationMode = InterpolationMode.NEAREST, **_):
    if interpolation is not InterpolationMode.NEAREST:
        raise NotImplementedError(f"diffpipe_cosmos.resize handles NEAREST only, got {interpolation}")
    return resize_nearest(img, size)


def install() -> None:
    """Give diffusers' Cosmos transformer module this resize when torchvision is missing (a no-op otherwise)."""
    import diffusers.models.transformers.transformer_cosmos as module

    if "transforms" not in vars(module):
        module.transforms = SimpleNamespace(
            functional=SimpleNamespace(resize=_resize), InterpolationMode=InterpolationMode
        )
