"""What Qwen2.5-VL sees of the reference images of an edit pair: each image resized as the edit pipelines resize it
before calling ``encode_prompt`` (the processor itself: :mod:`diffpipe_core.parts.vl_processors`)."""

from __future__ import annotations

from typing import Any

import torch

#: the pipelines' default area of the image Qwen2.5-VL sees (QwenImageEditPipeline, QwenImageEditPlusPipeline)
VL_AREA = {"QwenImageEditPipeline": 1024 * 1024, "QwenImageEditPlusPipeline": 384 * 384}


def to_pil(pixels: torch.Tensor) -> Any:
    """``(3, H, W)`` in [-1, 1] (as the data path decodes a control image) -> the 8-bit RGB image it came from."""
    from PIL import Image

    rgb = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return Image.fromarray(rgb.permute(1, 2, 0).cpu().numpy())


def vl_images(pixels: tuple[torch.Tensor, ...], area: int) -> list[Any]:
    """The reference images as the pipelines hand them to ``encode_prompt``: resized (Lanczos, the pipelines'
    ``image_processor.resize``) to about ``area`` pixels at their aspect ratio, sides rounded to 32
    (``calculate_dimensions``)."""
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    resizer = VaeImageProcessor(vae_scale_factor=16)
    out = []
    for p in pixels:
        image = to_pil(p)
        width, height = calculate_dimensions(area, image.width / image.height)
        out.append(resizer.resize(image, height, width))
    return out
