"""MiniMax H3's packed sequence: video latents as rows, stereo audio rows, the ``t2va`` layout and the two streams'
noise levels, as ``MiniMaxH3ModularPipeline`` builds them (its own layout builder and patchify are called, so the
rows, rotary coordinates and modality tags are the pipeline's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: the pipeline's fixed frame rate and audio latent rate (``MINIMAX_H3_FPS``, ``MINIMAX_H3_AUDIO_LATENTS_PER_SECOND``)
FPS = 24
AUDIO_LATENTS_PER_SECOND = 40
#: stereo, packed channel-major (``MINIMAX_H3_AUDIO_CHANNELS``); modality tags of the AdaLN table
AUDIO_CHANNELS = 2
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2


@dataclass(frozen=True)
class Layout:
    """The ``[text | audio | video]`` layout of one micro-batch (every item shares it): the rows' rotary coordinates
    ``(S, 3)``, modality tags ``(S,)``, which of the two noise levels (0 video and text, 1 audio) each row takes, and
    where the video and audio rows sit."""

    position_ids: torch.Tensor
    token_tags: torch.Tensor
    timestep_indices: torch.Tensor
    video_indices: torch.Tensor
    audio_indices: torch.Tensor


def layout(text_tokens: int, latent_shape: tuple[int, int, int], audio_latents: int,
           patch_size: tuple[int, int, int]) -> Layout:
    """``MiniMaxH3PrepareLayoutStep.build_packed_sequence`` for ``text_tokens`` text rows, video latents of
    ``(frames, height, width)`` and ``audio_latents`` per channel; the media's rotary clock starts after the text."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    f, h, w = latent_shape
    tags = torch.full((text_tokens,), TEXT_TAG, dtype=torch.long)
    position_ids, token_tags, video_indices, audio_indices, _, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, f, h, w, audio_latents, tuple(patch_size), AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG
    )
    timestep_indices = torch.zeros(position_ids.shape[0], dtype=torch.long)
    timestep_indices[audio_indices] = 1
    return Layout(position_ids, token_tags, timestep_indices, video_indices, audio_indices)


def patchify(latents: torch.Tensor, patch_size: tuple[int, int, int]) -> torch.Tensor:
    """``(B, C, F, H, W)`` -> ``(B, N, C p)`` rows, frame-major then row-major (the pipeline's
    ``patchify_video_latents``, per item)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    rows = patchify_video_latents(latents, tuple(patch_size))
    return rows.view(latents.shape[0], -1, rows.shape[-1])


def unpatchify(
    rows: torch.Tensor, latent_shape: tuple[int, int, int], patch_size: tuple[int, int, int]
) -> torch.Tensor:
    """Inverse of :func:`patchify` (``MiniMaxH3AfterDenoiseStep``): ``(B, N, C p)`` -> ``(B, C, F, H, W)``."""
    pt, ph, pw = patch_size
    f, h, w = latent_shape
    b = rows.shape[0]
    channels = rows.shape[-1] // (pt * ph * pw)
    x = rows.reshape(b, f // pt, h // ph, w // pw, channels, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(b, channels, f, h, w).contiguous()


def audio_latent_count(frames: int) -> int:
    """The pipeline's audio latents per channel for ``frames`` video frames (``audio_latent_num_frames``)."""
    return int(round(frames / FPS * AUDIO_LATENTS_PER_SECOND))


def model_times(sigma: torch.Tensor, audio_sigma: torch.Tensor) -> torch.Tensor:
    """``(B, 2)``: each item's video and audio noise levels in the model's convention ``t = 1 - sigma`` (1 clean),
    the two values :attr:`Layout.timestep_indices` selects between."""
    return torch.stack([1.0 - sigma.float(), 1.0 - audio_sigma.float()], dim=1)


def audio_sigma(sigma: torch.Tensor, video_shift: float, audio_shift: float) -> torch.Tensor:
    """The audio stream's noise level paired with the video's ``sigma``: the base level (``sigma`` unshifted by
    ``video_shift``) shifted by ``audio_shift``, as the pipeline's two schedulers pair their grids."""
    from diffpipe_core.diffusion import shift_timesteps

    base = sigma / (video_shift - (video_shift - 1.0) * sigma)
    return shift_timesteps(base, audio_shift)
