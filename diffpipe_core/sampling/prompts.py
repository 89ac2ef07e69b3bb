"""Encode the sample prompts once, with the plugin's own encoders, then free them.

An edit model's prompts come with control images (``[sample] control_images``): each is decoded at the sample size
(or, when the model asks for ``control_size = "own"``, at its own aspect ratio with the sample's pixel count, or
with the model's ``control_sample_area``), encoded through ``encode_batch`` with ``control_index`` set, exactly as a
training control image, and handed to the denoising hooks with the prompt's text tensors under ``control_<k>_<key>``
(the batch keys ``prepare_inputs`` sees). A model whose text encoder looks at the control images
(``control_in_captions``) gets them with the prompt and the negative prompt, as in training.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from diffpipe_core.registry import ModelPlugin
from diffpipe_core.sampling.loop import PromptText
from diffpipe_core.types import EncodeBatch, ModelConfigBase, ModelSpec, control_key


def encode_prompts(
    plugin: ModelPlugin,
    model_config: ModelConfigBase,
    prompts: Sequence[str],
    negative_prompt: str | None,
    device: torch.device,
    controls: Sequence[Sequence[Path]] | None = None,
    size: tuple[int, int] | None = None,
) -> list[PromptText]:
    """Each prompt's text tensors (as ``encode_batch`` returns them for captions, batch 1, on the CPU), and
    the negative prompt's when ``negative_prompt`` is not None; with ``controls`` (per prompt, its control image
    files) and ``size`` (the sample's width, height), each prompt's control tensors too. The encoders are loaded for
    this call only."""
    spec = plugin.spec
    pixels = [[load_control(p, spec, size) for p in images] for images in controls] if controls else None
    encoders = plugin.require("load_encoders", model_config=model_config, device=device)
    try:
        with torch.no_grad():
            texts = _texts(plugin, encoders, list(prompts), negative_prompt, pixels)
            if pixels is not None:
                for text, images in zip(texts, pixels, strict=True):
                    extra = _control_tensors(plugin, encoders, images)
                    text.cond.update(extra)
                    if text.uncond is not None:
                        text.uncond = {**text.uncond, **extra}
    finally:
        del encoders
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return texts


def _rows(encoded: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    return [{key: value[i : i + 1].detach().cpu() for key, value in encoded.items()} for i in range(n)]


def _texts(
    plugin: ModelPlugin,
    encoders: object,
    prompts: list[str],
    negative: str | None,
    pixels: list[list[torch.Tensor]] | None,
) -> list[PromptText]:
    if pixels is not None and plugin.spec.control_in_captions:  # the text encoder sees each prompt's images
        texts = []
        for prompt, images in zip(prompts, pixels, strict=True):
            batch = EncodeBatch(captions=[prompt], control_pixels=[tuple(images)])
            (cond,) = _rows(_encode(plugin, encoders, batch), 1)
            texts.append(PromptText(cond=cond, uncond=_negative(plugin, encoders, negative, tuple(images))))
        return texts
    rows = _rows(_encode(plugin, encoders, EncodeBatch(captions=prompts)), len(prompts))
    uncond = _negative(plugin, encoders, negative)
    return [PromptText(cond=row, uncond=uncond) for row in rows]


def _negative(
    plugin: ModelPlugin, encoders: object, negative: str | None, images: tuple[torch.Tensor, ...] | None = None
) -> dict[str, torch.Tensor] | None:
    """The negative prompt's text tensors, encoded on its own (``EncodeBatch.negative_prompt``, as pipelines encode
    it), with the prompt's control ``images`` for a model whose text encoder sees them; None without one."""
    if negative is None:
        return None
    controls = [images] if images is not None else None
    batch = EncodeBatch(captions=[negative], control_pixels=controls, negative_prompt=True)
    return _rows(_encode(plugin, encoders, batch), 1)[0]


def _encode(plugin: ModelPlugin, encoders: object, batch: EncodeBatch) -> dict[str, torch.Tensor]:
    encoded = plugin.require("encode_batch", encoders=encoders, batch=batch)
    if not encoded:
        raise ValueError(f"model plugin {plugin.name!r}: encode_batch returned no text tensors for the sample prompts")
    return encoded


def _control_tensors(plugin: ModelPlugin, encoders: object, images: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, pixels in enumerate(images):
        size = tuple(pixels.shape[-2:])
        batch = EncodeBatch(pixels=pixels[None], control_index=k, original_sizes=[size], crop_coords=[(0, 0)])
        encoded = plugin.require("encode_batch", encoders=encoders, batch=batch)
        out.update({control_key(k, key): value[:1].detach().cpu() for key, value in encoded.items()})
    return out


def load_control(path: Path, spec: ModelSpec, size: tuple[int, int] | None) -> torch.Tensor:
    """A sample's control image ``(3, H, W)`` in [-1, 1]: resized and center-cropped to ``size`` (width, height), or
    with ``control_size = "own"`` resized to the sample's pixel count at its own aspect ratio (sides rounded down to
    the model's multiple), or to ``control_sample_area`` where the model sets one (sides rounded to 32, as diffusers'
    edit pipelines' ``calculate_dimensions``), decoded like a training image."""
    from diffpipe_core.data.decode import load_media, probe_image
    from diffpipe_core.data.items import Bucket, MediaItem

    if size is None:
        raise ValueError("control images need the sample size")
    width, height = size
    if spec.control_size == "own":
        w0, h0 = probe_image(Path(path))
        if spec.control_sample_area:
            w = math.sqrt(spec.control_sample_area * w0 / h0)
            width, height = max(32, round(w / 32) * 32), max(32, round(w * h0 / w0 / 32) * 32)
        else:
            scale = math.sqrt(width * height / (w0 * h0))
            m = spec.spatial_multiple
            width, height = max(m, int(w0 * scale) // m * m), max(m, int(h0 * scale) // m * m)
    item = MediaItem(id=f"sample control image {path}", path=Path(path), caption="", bucket=Bucket(width, height, 1),
                     content_key="")
    return load_media(item, spec).pixels
