"""Qwen-Image-Edit (entry point ``qwen-image-edit``): Qwen-Image trained on edit pairs, as ``QwenImageEditPipeline``
(Qwen-Image-Edit, one reference image) and ``QwenImageEditPlusPipeline`` (Qwen-Image-Edit-2509 and later, up to
three) run it.

The instruction is encoded together with the reference images by Qwen2.5-VL, through the pipeline's own
``encode_prompt`` (its template, ``Picture k:`` labels for 2509), each image resized as the pipeline resizes it
first; the reference images' latents (normalised like the target's) are packed 2x2 and appended to the noisy
target's tokens, each with its own ``img_shapes`` entry (its RoPE frame index). The loss covers the target's tokens
(the final layer predicts only those). Loading, layouts and exports are Qwen-Image's. This module imports no torch.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl
from diffpipe_core.parts.folder import TOKENIZER, DiffusersFolder
from diffpipe_qwenimage.config import QwenImageEditConfig
from diffpipe_qwenimage.plugin import COMPONENTS, FILE_LAYOUTS, SIZES, QwenImage

if TYPE_CHECKING:
    import torch

    from diffpipe_core import EncodeBatch

log = logging.getLogger("diffpipe.qwenimage")
VISION_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
ONE_IMAGE = "QwenImageEditPipeline"


class QwenImageEdit(QwenImage):
    """Qwen-Image-Edit: every target has reference (control) images, decoded at their own aspect ratio."""
    tiny_writer = "diffpipe_qwenimage.testing:write_tiny_qwen_edit"  # python -m diffpipe_core.testing.tiny_models

    spec = replace(
        QwenImage.spec,
        name="qwen-image-edit",
        config_schema=QwenImageEditConfig,
        encoder_settings=(*QwenImage.spec.encoder_settings, "vl_image_area"),
        control_images="required",
        max_control_images=3,
        control_size="own",
        control_sample_area=1024 * 1024,  # both edit pipelines encode each reference at about 1024x1024
        control_in_captions=True,
        description="Qwen-Image-Edit and Edit-2509 edit pairs (diffusers folder, or ComfyUI's single file over it)",
    )
    folder = DiffusersFolder(
        "qwen-image-edit",
        ("QwenImageEditPlusPipeline", ONE_IMAGE),
        {**COMPONENTS, "processor": TOKENIZER},
        sizes=SIZES,
        single_file_example="qwen_image_edit_2509_bf16.safetensors",
        file_layouts=FILE_LAYOUTS,
    )

    @hookimpl
    def load_encoders(self, model_config: QwenImageEditConfig, device: torch.device) -> Any:
        """The VAE, and Qwen2.5-VL with its tokenizer and processor in a text-only pipeline of the folder's class
        (also one whose template lacks the vision block, for instructions without reference images)."""
        from diffpipe_core.parts.encoders import load_components
        from diffpipe_core.parts.text import text_pipeline
        from diffpipe_core.parts.vl_processors import load_processor
        from diffpipe_qwenimage.vision import VL_AREA

        enc = load_components(self.folder, model_config, device, "vae", "text_encoder", "tokenizer")
        enc.pipeline = json.loads((model_config.path / "model_index.json").read_text())["_class_name"]
        enc.processor = load_processor(model_config.path / "processor")
        parts = {"text_encoder": enc.text_encoder, "tokenizer": enc.tokenizer, "processor": enc.processor}
        enc.text, enc.text_alone = text_pipeline(enc.pipeline, **parts), text_pipeline(enc.pipeline, **parts)
        enc.text_alone.prompt_template_encode = enc.text.prompt_template_encode.replace(VISION_BLOCK, "")
        enc.vl_area = model_config.vl_image_area or VL_AREA[enc.pipeline]
        return enc

    @hookimpl
    def encode_batch(self, encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Qwen-Image's tensors; a caption batch's instructions are encoded with their reference images
        (``batch.control_pixels``), one instruction at a time."""
        if batch.control_index is not None:
            self.check_images(encoders, batch.control_index + 1)
        return super().encode_batch(encoders, batch)

    def check_images(self, encoders: Any, count: int) -> None:
        if count > 1 and encoders.pipeline == ONE_IMAGE:
            raise ValueError(
                f"{encoders.config.path}: a {ONE_IMAGE} (Qwen-Image-Edit) takes one reference image, but an item has "
                f"{count} (control_path folders); use one control_path, or a QwenImageEditPlusPipeline folder "
                "(Qwen-Image-Edit-2509) for up to three"
            )

    def encode_text(self, encoders: Any, batch: EncodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each instruction through ``encode_prompt`` with its reference images as the pipeline's ``__call__`` hands
        them over (:func:`~diffpipe_qwenimage.vision.vl_images` at ``vl_image_area``), padded to ``text_max_length``;
        an instruction without images (caption dropout's empty prompt) with the template minus its vision block."""
        import torch

        from diffpipe_core.parts.text import fixed_length
        from diffpipe_qwenimage.vision import vl_images

        length = encoders.config.text_max_length
        controls = batch.control_pixels or [()] * len(batch.captions)
        rows = []
        for caption, pixels in zip(batch.captions, controls, strict=True):
            self.check_images(encoders, len(pixels))
            images = vl_images(pixels, encoders.vl_area)
            pipe = encoders.text if images else encoders.text_alone
            image = (images[0] if encoders.pipeline == ONE_IMAGE else images) if images else None
            with torch.no_grad():
                embeds, _ = pipe.encode_prompt(caption, image=image, device=encoders.device)
            if embeds.shape[1] > length:
                log.warning("the embedding of %r with %d reference images has %d tokens; text_max_length keeps %d",
                            caption, len(images), embeds.shape[1], length)
            mask = torch.ones(embeds.shape[:2], dtype=torch.bool)
            rows.append(fixed_length(embeds.float().cpu(), mask, length))
        return torch.cat([e for e, _ in rows]), torch.cat([m for _, m in rows])

    def image_tokens(self, tokens: torch.Tensor, hw: tuple[int, int], source: dict[str, torch.Tensor]):
        """The packed target's tokens, then each reference image's (``control_<k>_latents`` of ``source``, a cached
        batch or the sample's text tensors), with their ``img_shapes`` rows, as the edit pipelines pack them."""
        import torch

        from diffpipe_core.parts.latents import pack_2x2
        from diffpipe_core.types import control_values

        parts, shapes = [tokens], [[1, hw[0] // 2, hw[1] // 2]]
        for ref in control_values(source, "latents"):
            parts.append(pack_2x2(ref.float()))
            shapes.append([1, ref.shape[-2] // 2, ref.shape[-1] // 2])
        return torch.cat(parts, dim=1), torch.tensor(shapes)


plugin = QwenImageEdit()
