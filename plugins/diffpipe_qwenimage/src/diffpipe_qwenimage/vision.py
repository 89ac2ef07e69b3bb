"""What Qwen2.5-VL sees of the reference images of an edit pair: the folder's processor, and each image resized as
the edit pipelines resize it before calling ``encode_prompt``; and Qwen-Image 2.1's Qwen3-VL processor, loaded the same
way without torchvision."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2VLProcessor, Qwen3VLProcessor

#: the pipelines' default area of the image Qwen2.5-VL sees (QwenImageEditPipeline, QwenImageEditPlusPipeline)
VL_AREA = {"QwenImageEditPipeline": 1024 * 1024, "QwenImageEditPlusPipeline": 384 * 384}


class WithoutVideos:
    """Mixin of a Qwen-VL processor without its video half. transformers 5 cannot build the video processor (nor
    check a missing one) without torchvision; images need neither, and everything else is the processor's own."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)  # type: ignore[misc]


class ImageOnlyProcessor(WithoutVideos, Qwen2VLProcessor):
    """``Qwen2VLProcessor`` (Qwen2.5-VL's) without its video half."""


class ImageOnlyQwen3VLProcessor(WithoutVideos, Qwen3VLProcessor):
    """``Qwen3VLProcessor`` (Qwen-Image 2.1's) without its video half."""


def load_processor(folder: Path, image_only: type = ImageOnlyProcessor) -> Any:
    """The folder's processor as its pipeline loads it (``AutoProcessor``) where torchvision is installed; without
    torchvision the same processor for images only (``image_only``: :class:`ImageOnlyProcessor` or
    :class:`ImageOnlyQwen3VLProcessor`): the PIL backend of its image processor, its tokenizer and its chat
    template."""
    from transformers import AutoTokenizer
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    images = Qwen2VLImageProcessorPil.from_pretrained(str(folder), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    template = Path(folder) / "chat_template.jinja"
    chat = template.read_text() if template.is_file() else None
    return image_only(image_processor=images, tokenizer=tokenizer, video_processor=None, chat_template=chat)


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
