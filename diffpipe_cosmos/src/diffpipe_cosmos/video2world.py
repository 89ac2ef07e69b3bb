"""Video-to-world conditioning (``[model] conditioning = "video"``) for both Cosmos generations, as
``CosmosVideoToWorldPipeline`` (1.0) and ``Cosmos2VideoToWorldPipeline`` (Predict2) use their conditioning video.

The pipelines VAE-encode the conditioning frames (padded to the clip's length) and mark the first
``1 + (frames - 1) // temporal`` latent frames as conditioning: ``cond_indicator`` ``(B, 1, T, 1, 1)`` and the
``cond_mask`` channel ``(B, 1, T, h, w)`` the transformer takes after the latents. Both VAEs are causal in time, so
those latent frames are the clip's own first latent frames: training conditions each clip on its own first
``conditioning_frames`` latent frames (images, 1 latent frame, on none). What the transformer sees on the
conditioning frames:

- 1.0: ``(x_0 + augment_sigma * noise) * c_in(augment_sigma)`` at the step's timestep; at noise levels not above
  ``augment_sigma`` the frames are not replaced (the pipeline's ``is_augment_sigma_greater``);
- Predict2: the clean ``x_0`` at timestep ``sigma_conditioning / (1 + sigma_conditioning)`` (per-frame timesteps).

Both pipelines replace the denoised latents of the conditioning frames by the conditioning latents; NVIDIA's trainers
do the same (``denoise_replace_gt_frames``), so those frames carry no loss: the loss mask is zero on them and the loss
is the mask-weighted mean over the generated frames. This module imports torch: the plugin's hooks import it when
they are called.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def indicator(latents: torch.Tensor, frames: int) -> torch.Tensor:
    """``cond_indicator`` ``(B, 1, T, 1, 1)``: 1 on the first ``frames`` latent frames, at most ``T - 1`` of them
    (an image, one latent frame, gets none: there would be nothing to generate)."""
    b, t = latents.shape[0], latents.shape[2]
    out = latents.new_zeros(b, 1, t, 1, 1, dtype=torch.float32)
    out[:, :, : min(frames, t - 1)] = 1.0
    return out


def mask_channel(cond: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """The pipelines' ``cond_mask`` ``(B, 1, T, h, w)`` from the indicator, for the latents' grid."""
    b, _, t, h, w = latents.shape
    return cond.expand(b, 1, t, h, w).to(latents.dtype)


def loss_mask(active: torch.Tensor, batch: dict[str, torch.Tensor], latents: torch.Tensor) -> torch.Tensor:
    """1 on the generated frames (0 where the conditioning replaced the frame), times the dataset's mask."""
    b, _, t, h, w = latents.shape
    mask = (1 - active).expand(b, 1, t, h, w)
    return mask * batch["mask"].float() if "mask" in batch else mask


def edm_inputs(
    latents: torch.Tensor, sample: Any, batch: dict[str, torch.Tensor], cfg: Any, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Cosmos-1.0: the first layer's ``(x | cond_mask, c_noise, t5_embeds)`` and the targets ``(x_0, x, sigma,
    sigma_data, loss mask)`` for the EDM sample ``sample`` (:func:`diffpipe_core.edm.edm_sample`); the augment noise
    is drawn after it."""
    noise = torch.randn(latents.shape, generator=generator)
    cond = indicator(latents, cfg.conditioning_frames)
    sigma = sample.sigma.view(-1, 1, 1, 1, 1)
    active = cond * (cfg.augment_sigma < sigma).float()
    c_in_augment = (cfg.augment_sigma**2 + cfg.sigma_data**2) ** -0.5
    augmented = (latents + noise * cfg.augment_sigma) * c_in_augment
    x = active * augmented + (1 - active) * sample.pre.c_in.view(-1, 1, 1, 1, 1) * sample.x
    x = torch.cat([x, mask_channel(cond, latents)], dim=1)
    sigma_data = torch.full((latents.shape[0],), cfg.sigma_data)
    targets = (latents, sample.x, sample.sigma, sigma_data, loss_mask(active, batch, latents))
    return (x, sample.pre.c_noise, batch["t5_embeds"].float()), targets


def flow_inputs(
    latents: torch.Tensor, flow: Any, batch: dict[str, torch.Tensor], cfg: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Predict2: ``(x | cond_mask, per-frame timesteps (B, 1, T, 1, 1), loss mask)`` for the flow sample ``flow``
    (:func:`diffpipe_core.parts.flow.flow_sample`): the conditioning frames clean at ``t_conditioning``."""
    cond = indicator(latents, cfg.conditioning_frames)
    t_cond = cfg.sigma_conditioning / (cfg.sigma_conditioning + 1)
    x = cond * latents + (1 - cond) * flow.x_t
    timestep = cond * t_cond + (1 - cond) * flow.t.view(-1, 1, 1, 1, 1).float()
    return torch.cat([x, mask_channel(cond, latents)], dim=1), timestep, loss_mask(cond, batch, latents)


# ---------------------------------------------------------------------------------------------- sampling
@dataclass
class SampleCondition:
    """One sample's conditioning: the normalised ``latents`` ``(1, C, T, h, w)`` of the padded conditioning video,
    ``cond`` ``(1, 1, T, 1, 1)`` and the noise ``generator`` the pipeline keeps drawing from (1.0's augment noise)."""

    latents: torch.Tensor
    cond: torch.Tensor
    generator: torch.Generator


def sample_inputs(
    variant: str, latents: torch.Tensor, sigma: torch.Tensor, condition: SampleCondition, cfg: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer input ``(x | cond_mask, timestep)`` at noise level ``sigma``: 1.0 as
    ``CosmosVideoToWorldPipeline`` (the conditioning latents with ``augment_sigma`` noise, the positive prompt's drawn
    first, then the negative's, where they replace; ``c_noise``), Predict2 as ``Cosmos2VideoToWorldPipeline`` (the
    clean conditioning latents at ``t_conditioning`` on the conditioning frames; per-frame ``t``)."""
    from diffpipe_core.edm import preconditioning

    cond, (b, _, frames, h, w) = replaced(variant, condition, sigma, cfg), latents.shape
    if variant == "1.0":
        pre, aug = preconditioning(sigma, cfg.sigma_data), cfg.augment_sigma
        c_in_augment = preconditioning(torch.tensor(aug), cfg.sigma_data).c_in
        shape = (1, *latents.shape[1:])
        noise = torch.cat([torch.randn(shape, generator=condition.generator) for _ in range(b)][::-1])
        augmented = (condition.latents + noise * aug) * c_in_augment / pre.c_in
        x = (cond * augmented + (1 - cond) * latents) * pre.c_in
        timestep = pre.c_noise.expand(b)
    else:
        t = sigma / (sigma + 1)
        sigma_cond = torch.tensor(cfg.sigma_conditioning, dtype=torch.float32)
        t_cond = sigma_cond / (sigma_cond + 1)
        x = cond * condition.latents + (1 - cond) * (latents * (1 - t))
        timestep = cond * t_cond + (1 - cond) * t.view(1, 1, 1, 1, 1).expand(b, -1, frames, -1, -1)
    return torch.cat([x, condition.cond.expand(b, 1, frames, h, w)], dim=1), timestep


def replaced(variant: str, condition: SampleCondition, sigma: torch.Tensor, cfg: Any) -> torch.Tensor:
    """The frames the conditioning replaces at ``sigma``: every conditioning frame (Predict2), none at noise levels
    not above ``augment_sigma`` (1.0)."""
    return condition.cond * 0 if variant == "1.0" and cfg.augment_sigma >= float(sigma) else condition.cond


def conditioning_pixels(path: Path, frames: int, width: int, height: int, spatial: int) -> torch.Tensor:
    """``(1, 3, F, H, W)`` in [-1, 1]: the first ``frames`` frames of the video at ``path`` (an image: itself, one
    frame), resized by the pipelines' ``VideoProcessor`` to ``width`` x ``height``."""
    from diffusers.video_processor import VideoProcessor
    from PIL import Image

    processor = VideoProcessor(vae_scale_factor=spatial)
    if Path(path).suffix.lower() in {".png", ".jpg", ".jpeg", ".webp", ".bmp"}:
        with Image.open(path) as opened:
            image = opened.convert("RGB")
        return processor.preprocess(image, height, width).unsqueeze(2)
    return processor.preprocess_video(read_frames(Path(path), frames), height, width)


def read_frames(path: Path, frames: int) -> list[Any]:
    """The first ``frames`` frames of a video file as RGB PIL images (fewer when the video is shorter)."""
    import av

    out = []
    try:
        with av.open(str(path)) as container:
            for frame in container.decode(container.streams.video[0]):
                out.append(frame.to_image().convert("RGB"))
                if len(out) == frames:
                    break
    except Exception as exc:
        raise ValueError(f"{path}: cannot read the sample conditioning video ({type(exc).__name__}: {exc})") from None
    if not out:
        raise ValueError(f"{path}: the sample conditioning video has no frames")
    return out


def pad_frames(pixels: torch.Tensor, frames: int, repeat_last: bool) -> tuple[torch.Tensor, int]:
    """The conditioning video padded to ``frames`` pixel frames (Predict2: its last frame repeated; 1.0: zeros), as
    the pipelines' ``prepare_latents``, and its own frame count."""
    have = pixels.shape[2]
    if have >= frames:
        return pixels[:, :, -frames:], frames  # the pipelines keep the last ones
    if repeat_last:
        pad = pixels[:, :, -1:].repeat(1, 1, frames - have, 1, 1)
    else:
        pad = pixels.new_zeros(*pixels.shape[:2], frames - have, *pixels.shape[3:])
    return torch.cat([pixels, pad], dim=2), have
