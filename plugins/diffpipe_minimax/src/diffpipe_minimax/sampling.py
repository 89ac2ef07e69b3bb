"""MiniMax H3 samples as ``MiniMaxH3ModularPipeline`` generates a ``t2va`` request: its noise (the video latents, then
the audio rows, from one generator), its two schedules (the folder's ``scheduler`` and ``audio_scheduler``), its
scheduler step for each stream, and its decoding (the video VAE and the stereo audio VAE).

The sampler carries one tensor: the video rows then the audio rows, flattened side by side
(:func:`diffpipe_minimax.layers.join`), as the head returns its prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffpipe_minimax.layers import join, split
from diffpipe_minimax.packing import AUDIO_CHANNELS, audio_latent_count, layout, patchify, unpatchify

#: ``AutoencoderKLMiniMaxH3.decode`` fails on fewer latent frames (an image's 1, 5 frames' 2): 22 frames and up decode
MIN_DECODED_LATENT_FRAMES = 7


@dataclass(frozen=True)
class Grid:
    """A sample's geometry: its latent ``(F, H, W)``, patch, audio latents per channel, and the audio sigmas."""

    shape: tuple[int, int, int]
    patch: tuple[int, int, int]
    audio_latents: int
    audio_channels: int
    audio_sigmas: torch.Tensor
    channels: int

    @property
    def video_rows(self) -> tuple[int, int]:
        f, h, w = self.shape
        pt, ph, pw = self.patch
        return (f // pt) * (h // ph) * (w // pw), self.channels * pt * ph * pw

    @property
    def audio_rows(self) -> tuple[int, int]:
        return AUDIO_CHANNELS * self.audio_latents, self.audio_channels


def schedules(folder: Path, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The video and audio sigmas of the folder's two ``MiniMaxH3Scheduler`` s for ``steps`` model evaluations (the
    pipeline's ``num_inference_steps`` is ``steps + 1``: its grid holds the terminal 0)."""
    from diffusers import MiniMaxH3Scheduler

    out = []
    for name, shift in (("scheduler", 12.0), ("audio_scheduler", 3.0)):  # the pipeline's where a folder has none
        own = (folder / name / "scheduler_config.json").is_file()
        scheduler = MiniMaxH3Scheduler.from_pretrained(str(folder / name)) if own else MiniMaxH3Scheduler(shift)
        scheduler.set_timesteps(steps + 1)
        out.append(scheduler.sigmas.float())
    return out[0], out[1]


def latent_frames(frames: int) -> int:
    """Latent frames of ``frames`` (17 n + 5 -> 5 n + 2; an image, 1 -> 1), as the video VAE makes them."""
    return 1 if frames == 1 else (frames - 5) // 17 * 5 + 2


def init(vae_config: dict[str, Any], audio_config: dict[str, Any], transformer_config: dict[str, Any],
         folder: Path, frames: int, height: int, width: int, steps: int,
         generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, Grid]:
    """The joined starting noise (the video's ``(1, C, F, H, W)`` draw, then the audio rows ``(2 L, Ca)``), the video
    sigmas and the sample's :class:`Grid`."""
    channels = int(vae_config.get("latent_channels", 24))
    factor = 1
    for d in vae_config.get("spatial_downsample_factors", (2, 2, 2, 2, 1, 1)):
        factor *= int(d)
    shape = (latent_frames(frames), height // factor, width // factor)
    patch = tuple(transformer_config.get("patch_size", (1, 2, 2)))
    video = torch.randn((1, channels, *shape), generator=generator)
    count = audio_latent_count(frames)
    audio_channels = int(audio_config.get("latent_channels", 32))
    audio = torch.randn((AUDIO_CHANNELS * count, audio_channels), generator=generator)
    video_sigmas, audio_sigmas = schedules(folder, steps)
    grid = Grid(shape, patch, count, audio_channels, audio_sigmas, channels)  # type: ignore[arg-type]
    return join(patchify(video, patch), audio[None]), video_sigmas, grid


def inputs(latents: torch.Tensor, sigmas: torch.Tensor, index: int, text: dict[str, torch.Tensor],
           grid: Grid) -> tuple[torch.Tensor, ...]:
    """The first layer's inputs (:mod:`diffpipe_minimax.layers`) for the joined ``latents`` at step ``index``."""
    from diffpipe_minimax.training import trim_text

    video, audio = split(latents.float(), grid.video_rows, grid.audio_rows)
    embeds, mask = trim_text(text["text_embeds"], text["text_mask"])
    lay = layout(embeds.shape[1], grid.shape, grid.audio_latents, grid.patch)
    b = latents.shape[0]
    times = torch.stack([1.0 - sigmas[index].float(), 1.0 - grid.audio_sigmas[index].float()]).expand(b, 2)
    return (video, audio, times, lay.timestep_indices, lay.token_tags, lay.position_ids.float(), embeds, mask,
            lay.video_indices, lay.audio_indices)


def euler(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """``MiniMaxH3Scheduler.step``: ``x0 = x + (1 - t) v`` at ``t = 1 - sigma``, then ``r x + (1 - r) x0`` with
    ``r = sigma_next / sigma``."""
    denoised = x + (1 - (1 - sigma)) * v
    ratio = sigma_next / sigma
    return ratio * x + (1.0 - ratio) * denoised


def step(latents: torch.Tensor, prediction: torch.Tensor, sigmas: torch.Tensor, index: int,
         grid: Grid) -> torch.Tensor:
    """One step of both streams, each down its own schedule."""
    video, audio = split(latents.float(), grid.video_rows, grid.audio_rows)
    v_video, v_audio = split(prediction.float(), grid.video_rows, grid.audio_rows)
    video = euler(video, v_video, sigmas[index], sigmas[index + 1])
    audio = euler(audio, v_audio, grid.audio_sigmas[index], grid.audio_sigmas[index + 1])
    return join(video, audio)


def decode_video(vae: Any, latents: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``MiniMaxH3AfterDenoiseStep`` and ``MiniMaxH3VideoDecodeStep``: the video rows unpatchified, denormalised and
    decoded, the VAE's ImageNet-normalised RGB reverted; float RGB in [-1, 1], ``(B, 3, F, H, W)``."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline as Pipe

    if grid.shape[0] < MIN_DECODED_LATENT_FRAMES:
        raise ValueError(f"minimax-h3: the video VAE decodes at least {MIN_DECODED_LATENT_FRAMES} latent frames "
                         f"(22 frames); this sample has {grid.shape[0]}: set [sample] frames to 17 k + 5 with k >= 1")
    video, _ = split(latents.float(), grid.video_rows, grid.audio_rows)
    param = next(vae.parameters())
    z = unpatchify(video, grid.shape, grid.patch).to(param.device)
    mean = torch.tensor(vae.config.latents_mean, device=z.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=z.device).view(1, -1, 1, 1, 1)
    pixel_mean = torch.tensor(Pipe.pixel_mean.fget(None), device=z.device).view(1, -1, 1, 1, 1)  # type: ignore
    pixel_std = torch.tensor(Pipe.pixel_std.fget(None), device=z.device).view(1, -1, 1, 1, 1)  # type: ignore
    with torch.no_grad():
        pixels = vae.decode((z * std + mean).to(param.dtype), return_dict=False)[0]
    return ((pixels.float() * pixel_std + pixel_mean).clamp(0, 1) * 2 - 1).cpu()


def decode_audio(audio_vae: Any, latents: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``MiniMaxH3AudioDecodeStep``: the audio rows as the stereo pair of the mono audio VAE, denormalised and
    decoded: ``(B, 2, S)``."""
    _, audio = split(latents.float(), grid.video_rows, grid.audio_rows)
    param = next(audio_vae.parameters())
    out = []
    for rows in audio:
        z = rows.reshape(AUDIO_CHANNELS, grid.audio_latents, -1).permute(0, 2, 1)
        mean = torch.tensor(audio_vae.config.latents_mean).view(1, -1, 1)
        std = torch.tensor(audio_vae.config.latents_std).view(1, -1, 1)
        with torch.no_grad():
            wave = audio_vae.decode((z * std + mean).to(param.device, param.dtype), return_dict=False)[0]
        out.append(wave.float().permute(1, 0, 2)[0].cpu())
    return torch.stack(out)
