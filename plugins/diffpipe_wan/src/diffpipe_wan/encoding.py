"""What Wan caches and how its pipelines build the same tensors: normalised VAE latents, UMT5 text, and (image-to-
video) the first-frame conditioning and CLIP vision embeddings, as ``WanPipeline.encode_prompt`` and
``WanImageToVideoPipeline.prepare_latents`` / ``encode_image`` compute them."""

from __future__ import annotations

import sys
from typing import Any

import torch

from diffpipe_core.parts.latents import latent_mask, per_channel, vae_mode

_told: set[tuple[int, int]] = set()


def normalize(z: torch.Tensor, vae: Any) -> torch.Tensor:
    """``(z - latents_mean) * (1 / latents_std)`` per channel, the pipelines' own operations."""
    mean = per_channel(vae.config.latents_mean, z)
    return (z - mean) * per_channel(1.0 / torch.tensor(vae.config.latents_std), z)


def denormalize(latents: torch.Tensor, vae: Any) -> torch.Tensor:
    """``latents / (1 / latents_std) + latents_mean``, as the pipelines undo :func:`normalize` before decoding."""
    z = latents.float()
    return z / per_channel(1.0 / torch.tensor(vae.config.latents_std), z) + per_channel(vae.config.latents_mean, z)


def latents(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    """The normalised posterior mode of ``(B, 3, F, H, W)`` clips (or ``(B, 3, H, W)`` images, one frame), on CPU."""
    return normalize(vae_mode(vae, pixels, video=True), vae).cpu()


def loss_mask(masks: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """``(B, 1, H, W)`` pixel masks on the latent grid: ``(B, 1, 1, h, w)``, one for every latent frame."""
    return latent_mask(masks, latents.shape, video=True).cpu()


def pixel_multiple(vae_config: Any, transformer_config: dict[str, Any]) -> int:
    """Pixels per token side: the VAE's spatial factor x the transformer's patch (16 for Wan 2.1, 32 for Wan 2.2's
    16x VAE)."""
    return int(vae_config.scale_factor_spatial) * int(transformer_config.get("patch_size", (1, 2, 2))[-1])


def fit_to_patches(pixels: torch.Tensor, masks: torch.Tensor | None, encoders: Any, *more: torch.Tensor | None):
    """``pixels`` (and ``masks`` and ``more``, e.g. first frames) center-cropped to the model's pixel multiple.

    The core's buckets are multiples of 16 pixels (Wan 2.1's 8x VAE x 2x2 patches); Wan 2.2's 16x VAE needs
    multiples of 32, so a bucket of an odd multiple of 16 loses 8 pixels on each side (said once per size)."""
    m = encoders.multiple
    h, w = pixels.shape[-2:]
    new_h, new_w = h // m * m, w // m * m
    if (new_h, new_w) == (h, w):
        return (pixels, masks, *more)
    if new_h == 0 or new_w == 0:
        raise ValueError(f"a {w}x{h} bucket is smaller than this Wan model's {m}-pixel patches; use larger resolutions")
    if (h, w) not in _told:
        _told.add((h, w))
        print(
            f"diffpipe-wan: {w}x{h} is not a multiple of this model's {m}-pixel patches: center-cropped to {new_w}x"
            f"{new_h} (give resolutions in multiples of {m} to train on whole frames)",
            file=sys.stderr,
            flush=True,
        )
    top, left = (h - new_h) // 2, (w - new_w) // 2

    def crop(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[..., top : top + new_h, left : left + new_w]

    return (crop(pixels), crop(masks), *(crop(t) for t in more))


def text(encoders: Any, captions: list[str]) -> torch.Tensor:
    """``(B, text_max_length, d)`` UMT5 embeddings: ``prompt_clean``ed captions, the encoder run with its attention
    mask, each caption's own tokens kept and the rest zero (``WanPipeline._get_t5_prompt_embeds``)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    from diffpipe_core.parts.text import TextEncoding, encode_text

    spec = TextEncoding(encoders.config.text_max_length, use_mask=True, zero_padding=True)
    return encode_text(encoders.text_encoder, encoders.tokenizer, [prompt_clean(c) for c in captions], spec).embeds


def latent_shape(vae: dict[str, Any], transformer: dict[str, Any], request: Any) -> tuple[int, ...]:
    """``(1, z, F', h, w)`` of a sample (``vae`` and ``transformer``: their ``config.json``): the request's size rounded
    down to the pixel multiple, as the pipelines round it."""
    spatial, temporal = int(vae.get("scale_factor_spatial", 8)), int(vae.get("scale_factor_temporal", 4))
    patch = int(transformer.get("patch_size", (1, 2, 2))[-1])
    h, w = request.height // (spatial * patch) * patch, request.width // (spatial * patch) * patch
    return 1, int(vae.get("z_dim", 16)), (request.frames - 1) // temporal + 1, h, w


# ---------------------------------------------------------------------------------------------- image-to-video
def first_frame_latents(
    vae: Any, first_frames: torch.Tensor, frames: int, last_frames: torch.Tensor | None = None
) -> torch.Tensor:
    """``(B, z, F', h, w)``: the normalised latents of each clip ``[first frame, zeros, ...]`` of ``frames`` frames,
    or with ``last_frames`` ``[first frame, zeros, ..., last frame]`` (``WanImageToVideoPipeline.prepare_latents``'
    ``latent_condition``, without and with its ``last_image``)."""
    image = first_frames.unsqueeze(2)
    b, c, _, h, w = image.shape
    last = () if last_frames is None else (last_frames.unsqueeze(2),)
    video = torch.cat([image, image.new_zeros(b, c, frames - 1 - len(last), h, w), *last], dim=2)
    return latents(vae, video)


def first_frame_mask(
    batch: int, latent_frames: int, h: int, w: int, temporal: int = 4, last: bool = False
) -> torch.Tensor:
    """``(B, temporal, F', h, w)``: 1 on the latent frame of the given first frame (and with ``last`` on the pixel
    frame of the given last one), 0 on the generated ones, laid out as ``WanImageToVideoPipeline.prepare_latents`` lays
    out its mask (the first pixel frame repeated ``temporal`` times, then ``temporal`` pixel frames per latent
    frame)."""
    frames = temporal * (latent_frames - 1) + 1
    mask = torch.ones(batch, 1, frames, h, w)
    mask[:, :, 1 : frames - 1 if last else frames] = 0
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=temporal)
    mask = torch.cat([first, mask[:, :, 1:]], dim=2)
    return mask.view(batch, -1, temporal, h, w).transpose(1, 2)


def sample_images(files: list[Any], vae_config: dict[str, Any], h: int, w: int) -> list[tuple[Any, torch.Tensor]]:
    """Each image file as ``(PIL RGB image, pixels (1, 3, H, W))``, resized to the ``h`` x ``w`` latent grid's pixels
    as the Wan pipelines' ``video_processor.preprocess`` resizes them."""
    from PIL import Image

    spatial = int(vae_config.get("scale_factor_spatial", 8))
    out = []
    for file in files:
        with Image.open(file) as opened:
            image = opened.convert("RGB")
        out.append((image, pipeline_pixels(image, h * spatial, w * spatial, spatial)))
    return out


def pipeline_pixels(image: Any, height: int, width: int, spatial: int) -> torch.Tensor:
    """``(1, 3, height, width)`` in [-1, 1]: a PIL image resized as the Wan pipelines' ``video_processor.preprocess``
    resizes their ``image`` and ``last_image`` (to exactly that size)."""
    from diffusers.video_processor import VideoProcessor

    return VideoProcessor(vae_scale_factor=spatial).preprocess(image, height=height, width=width).float()


def to_images(first_frames: torch.Tensor) -> list[Any]:
    """``(B, 3, H, W)`` frames in [-1, 1] (decoded from 8-bit media) back to the PIL images they were."""
    from PIL import Image

    arr = ((first_frames.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(a) for a in arr]


def clip_embeds(image_encoder: Any, image_processor: Any, first: list[Any], last: list[Any] | None) -> torch.Tensor:
    """``(B, n, d)`` :func:`image_embeds` of the first frames, or with ``last`` ``(B, 2n, d)``: each sample's first and
    last frame's side by side (``WanImageToVideoPipeline.encode_image([image, last_image])``, one sample's two rows)."""
    if last is None:
        return image_embeds(image_encoder, image_processor, first)
    pairs = image_embeds(image_encoder, image_processor, [im for pair in zip(first, last, strict=True) for im in pair])
    return pairs.reshape(len(first), -1, pairs.shape[-1])


@torch.no_grad()
def image_embeds(image_encoder: Any, image_processor: Any, images: list[Any]) -> torch.Tensor:
    """``(B, n, d)`` CLIP vision embeddings of PIL ``images``: the image processor, then the encoder's penultimate
    hidden state (``WanImageToVideoPipeline.encode_image``), float32 on CPU."""
    param = next(image_encoder.parameters())
    inputs = image_processor(images=images, return_tensors="pt").to(param.device)
    return image_encoder(**inputs, output_hidden_states=True).hidden_states[-2].float().cpu()
