"""The VACE conditioning, as ``WanVACEPipeline`` builds it (``prepare_video_latents``, ``prepare_masks``, the
reference images, concatenated on the channels).

For a control video ``(B, 3, F, H, W)`` in [-1, 1] and its mask ``(B, 1, F, H, W)`` in [0, 1] (1: generate; the
pipeline's default is all ones), the conditioning is ``[inactive | reactive | mask]``: the normalised VAE latents of
``video * (1 - m)`` and ``video * m`` (``m`` the mask thresholded at 0.5), and the mask's 8x8 pixel blocks folded
into 64 channels on the latent grid (nearest in time). Each reference image adds a latent frame in front: its
normalised latent and zeros, and a zero mask.
"""

from __future__ import annotations

from typing import Any

import torch

from diffpipe_core.parts.latents import vae_mode
from diffpipe_wan.encoding import normalize

MASK_CHANNELS = 64  # the 8x8 pixels under each latent pixel (Wan 2.1's VAE)


def video_latents(vae: Any, video: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[inactive | reactive]`` (B, 2z, F', h, w): ``prepare_video_latents`` without reference images."""
    m = torch.where(mask > 0.5, 1.0, 0.0).to(video.dtype)
    inactive, reactive = vae_mode(vae, video * (1 - m), video=True), vae_mode(vae, video * m, video=True)
    return torch.cat([normalize(inactive, vae), normalize(reactive, vae)], dim=1)


def mask_latents(mask: torch.Tensor, spatial: int, temporal: int, patch: int) -> torch.Tensor:
    """The mask on the latent grid (B, spatial^2, F', h, w): ``prepare_masks`` without reference images."""
    b, _, frames, height, width = mask.shape
    new_frames = (frames + temporal - 1) // temporal
    new_h = height // (spatial * patch) * patch
    new_w = width // (spatial * patch) * patch
    m = mask[:, 0].reshape(b, frames, new_h, spatial, new_w, spatial).permute(0, 3, 5, 1, 2, 4).flatten(1, 2)
    return torch.nn.functional.interpolate(m, size=(new_frames, new_h, new_w), mode="nearest-exact")


def with_references(latents: torch.Tensor, masks: torch.Tensor, vae: Any, references: torch.Tensor | None):
    """``latents`` and ``masks`` with each reference image ``(B, R, 3, H, W)`` (pixels at the video's size) as a
    latent frame in front, the last one first (as the pipeline prepends them one by one); unchanged without."""
    if references is None or references.shape[1] == 0:
        return latents, masks
    for r in range(references.shape[1]):
        ref = normalize(vae_mode(vae, references[:, r], video=True), vae)
        latents = torch.cat([torch.cat([ref, torch.zeros_like(ref)], dim=1), latents], dim=2)
    padding = masks.new_zeros(masks.shape[0], masks.shape[1], references.shape[1], *masks.shape[3:])
    return latents, torch.cat([padding, masks], dim=2)


def fit_references(references: list[tuple[Any, ...]], height: int, width: int, spatial: int) -> torch.Tensor:
    """``(B, R, 3, height, width)``: each item's reference images (PIL images, or ``(3, h, w)`` in [-1, 1] at their own
    size as decoded from 8-bit files) as ``WanVACEPipeline.preprocess_conditions`` prepares them:
    ``video_processor.preprocess`` of the image, resized (bilinear) to fit inside the video keeping its aspect ratio,
    centered on a white canvas."""
    from diffusers.video_processor import VideoProcessor

    from diffpipe_wan.encoding import to_images

    processor = VideoProcessor(vae_scale_factor=spatial)
    out = []
    for item in references:
        fitted = []
        for image in (to_images(r[None])[0] if isinstance(r, torch.Tensor) else r for r in item):
            pixels = processor.preprocess(image, None, None).float()
            h, w = pixels.shape[-2:]
            scale = min(height / h, width / w)
            new_h, new_w = int(h * scale), int(w * scale)
            resized = torch.nn.functional.interpolate(pixels, size=(new_h, new_w), mode="bilinear",
                                                      align_corners=False)[0]
            top, left = (height - new_h) // 2, (width - new_w) // 2
            canvas = torch.ones(3, height, width)
            canvas[:, top : top + new_h, left : left + new_w] = resized
            fitted.append(canvas)
        out.append(torch.stack(fitted))
    return torch.stack(out)


@torch.no_grad()
def context(
    vae: Any, video: torch.Tensor, mask: torch.Tensor | None = None, references: torch.Tensor | None = None,
    patch: int = 2,
) -> torch.Tensor:
    """The transformer's ``control_hidden_states`` (B, 2z + 64, R + F', h, w) of a control video, its mask (None:
    all ones, the pipeline's default) and reference images, on CPU, float32."""
    mask = torch.ones_like(video[:, :1]) if mask is None else mask
    spatial = int(vae.config.scale_factor_spatial)
    temporal = int(vae.config.scale_factor_temporal)
    latents = video_latents(vae, video, mask)
    masks = mask_latents(mask, spatial, temporal, patch).to(latents.dtype)
    latents, masks = with_references(latents, masks.to(latents.device), vae, references)
    return torch.cat([latents, masks], dim=1).float().cpu()
