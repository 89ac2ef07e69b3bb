"""Qwen-VL processors (Qwen2.5-VL's ``Qwen2VLProcessor``, Qwen3-VL's ``Qwen3VLProcessor``) without torchvision.

transformers 5 cannot build a Qwen-VL processor's video half (nor check a missing one) without torchvision, which
this project never depends on. Images and text need neither: :func:`load_processor` gives the folder's processor as
its pipeline loads it where torchvision is installed, else the same processor for images only (the PIL backend of its
image processor, its tokenizer, its chat template). Models whose pipelines take a Qwen-VL processor (Qwen-Image-Edit,
Qwen-Image 2.1, and the Qwen3-VL-conditioned models after them) load it from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import Qwen2VLProcessor, Qwen3VLProcessor


class WithoutVideos:
    """Mixin of a Qwen-VL processor without its video half; everything else is the processor's own."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)  # type: ignore[misc]


class ImageOnlyProcessor(WithoutVideos, Qwen2VLProcessor):
    """``Qwen2VLProcessor`` (Qwen2.5-VL's) without its video half."""


class ImageOnlyQwen3VLProcessor(WithoutVideos, Qwen3VLProcessor):
    """``Qwen3VLProcessor`` (Qwen3-VL's) without its video half."""


def load_processor(folder: Path, image_only: type = ImageOnlyProcessor) -> Any:
    """The folder's processor as its pipeline loads it (``AutoProcessor``) where torchvision is installed; without
    torchvision the same processor for images only (``image_only``: :class:`ImageOnlyProcessor` or
    :class:`ImageOnlyQwen3VLProcessor`): the PIL backend of its image processor, its tokenizer and its chat
    template (``chat_template.jinja``)."""
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


def save_processor(processor: Any, folder: Path) -> Path:
    """An image-only processor saved as the pipeline's ``processor/`` folder (its own ``save_pretrained`` needs the
    video half): its image processor, tokenizer and chat template, which :func:`load_processor` reads back."""
    folder = Path(folder)
    for part in (processor.image_processor, processor.tokenizer):
        part.save_pretrained(str(folder))
    if processor.chat_template:
        (folder / "chat_template.jinja").write_text(processor.chat_template)
    return folder
