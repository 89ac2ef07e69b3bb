"""MiniMax H3's training step: the first layer's inputs from a cached micro-batch, and the joint loss."""

from __future__ import annotations

from typing import Any

import torch

from diffpipe_core.types import TrainingContext
from diffpipe_minimax.layers import join
from diffpipe_minimax.packing import audio_sigma, layout, model_times, patchify

Tensors = tuple[torch.Tensor, ...]


def weights(batch: dict[str, torch.Tensor], latents: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """The video rows' loss weights: the cached loss mask (broadcast over channels and frames) as rows, else ones."""
    mask = batch.get("mask")
    full = torch.ones_like(latents) if mask is None else mask.float().expand_as(latents)
    return patchify(full, patch)


def trim_text(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached text cut to the micro-batch's longest caption (none for a micro-batch of empty captions)."""
    n = int(mask.sum(dim=1).max())
    return embeds[:, :n].float(), mask[:, :n].bool()


def training_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator,
                    patch: tuple[int, int, int], audio_channels: int) -> tuple[Tensors, Tensors]:
    """``(inputs, (video target, audio target, video weight, audio weight))``; see
    :meth:`diffpipe_minimax.plugin.MiniMaxH3.prepare_inputs` (``audio_channels``: the transformer's audio latent
    channels, for a micro-batch without audio rows). Draws the video noise, the times, then (with audio
    rows) the audio noise, all from ``generator``."""
    from diffpipe_core.parts.flow import flow_sample

    cfg: Any = context.model_config
    latents = batch["latents"].float()
    b, _, f, h, w = latents.shape
    s = flow_sample(latents, cfg, context, generator)
    video = patchify(s.x_t, patch)
    video_target = -patchify(s.target, patch)  # x0 - noise: the data-ward velocity
    video_weight = weights(batch, latents, patch) * float(cfg.train_video)
    sigma_a = audio_sigma(s.t, cfg.video_shift, cfg.audio_shift)
    clean = batch.get("audio_latents")
    present = batch.get("audio_mask")
    if clean is None or present is None or not bool(present.bool().any()):  # no sound: no audio rows (the anchor's)
        audio = torch.zeros(b, 0, audio_channels)
        audio_target, audio_weight = audio.clone(), audio.clone()
    else:
        clean = clean.float()
        noise = torch.randn(clean.shape, generator=generator)
        sa = sigma_a.view(b, 1, 1)
        audio, audio_target = (1 - sa) * clean + sa * noise, clean - noise
        audio_weight = (present.float().view(b, 1, 1) * float(cfg.train_audio)).expand_as(audio).clone()
    text, text_mask = trim_text(batch["text_embeds"], batch["text_mask"])
    lay = layout(text.shape[1], (f, h, w), audio.shape[1] // 2, patch)
    inputs = (video, audio, model_times(s.t, sigma_a), lay.timestep_indices, lay.token_tags,
              lay.position_ids.float(), text, text_mask, lay.video_indices, lay.audio_indices)
    return inputs, (video_target, audio_target, video_weight, audio_weight)


def joint_loss(outputs: Tensors, targets: Tensors, context: TrainingContext) -> torch.Tensor:
    """The run's elementwise loss over the video and audio values together, weighted, each value counting the same
    (the anchor's rule), in float32."""
    from diffpipe_core.diffusion import training_loss

    video_target, audio_target, video_weight, audio_weight = targets
    target = join(video_target, audio_target).to(outputs[0].device)
    weight = join(video_weight, audio_weight).to(outputs[0].device)
    return training_loss(outputs[0], target, weight, context)
