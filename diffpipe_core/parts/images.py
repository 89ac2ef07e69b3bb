"""Frames as the PIL images image encoders' processors take (first-frame conditioning of image-to-video models)."""

from __future__ import annotations

from typing import Any

import torch


def to_pil_images(frames: torch.Tensor) -> list[Any]:
    """``(B, 3, H, W)`` frames in [-1, 1] (decoded from 8-bit media) back to the 8-bit PIL images they were."""
    from PIL import Image

    arr = ((frames.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in arr]
