"""The one rectified-flow input/loss builder of diffusers-backed flow models.

``flow_sample`` draws, from the micro-batch's generator and in this order, the noise and then the times (the order
every bundled flow plugin has always used, so their runs reproduce bit for bit), shifts the times, maps them onto
``[min_t, max_t]`` and forms ``x_t`` and the velocity target. Plugins add only their packing and their first
layer's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from diffpipe_core.diffusion import flow_matching_pair, sample_timesteps, training_loss

if TYPE_CHECKING:
    from diffpipe_core.parts.config import FlowMatchingConfig
    from diffpipe_core.types import TrainingContext

Tensors = tuple[torch.Tensor, ...]


@dataclass
class FlowSample:
    """``x_t = (1 - t) x + t noise``, its velocity target ``noise - x``, the per-sample times ``t`` and the noise."""

    x_t: torch.Tensor
    target: torch.Tensor
    t: torch.Tensor
    noise: torch.Tensor


def limit_times(t: torch.Tensor, min_t: float, max_t: float) -> torch.Tensor:
    """Map times in (0, 1) linearly onto ``[min_t, max_t]``; the identity for the full range."""
    if min_t == 0.0 and max_t == 1.0:
        return t
    return min_t + (max_t - min_t) * t


def flow_sample(
    latents: torch.Tensor,
    cfg: FlowMatchingConfig,
    context: TrainingContext,
    generator: torch.Generator,
    shift: float | None = None,
    time_range: tuple[float, float] | None = None,
) -> FlowSample:
    """Noise and times for one micro-batch of ``latents`` (any layout, batch first), all from ``generator``.

    ``shift`` overrides ``cfg.shift`` (a resolution-dependent shift computed by the plugin), ``time_range`` the
    ``(cfg.min_t, cfg.max_t)`` range (e.g. :meth:`~diffpipe_core.parts.config.FlowMatchingConfig.time_range` of a
    model's own default range). While evaluating (``context.eval_quantile``), every sample gets that quantile of the
    time distribution."""
    latents = latents.float()
    noise = torch.randn(latents.shape, generator=generator)
    t = sample_timesteps(
        latents.shape[0],
        generator,
        cfg.timestep_sample_method,
        cfg.sigmoid_scale,
        cfg.shift if shift is None else shift,
        quantile=context.eval_quantile,
    )
    t = limit_times(t, *(time_range or (cfg.min_t, cfg.max_t)))
    x_t, target = flow_matching_pair(latents, noise, t)
    return FlowSample(x_t, target, t, noise)


def with_mask(targets: Tensors, batch: dict[str, torch.Tensor], transform=None) -> Tensors:
    """``targets`` plus the batch's loss mask (``transform``ed, e.g. packed like the latents) when it has one."""
    if "mask" not in batch:
        return targets
    mask = batch["mask"].float()
    return targets + ((transform(mask) if transform else mask),)


def flow_loss(outputs: Tensors, targets: Tensors, context: TrainingContext | None = None) -> torch.Tensor:
    """The run's loss (``context.loss``: squared error unless run.toml sets ``pseudo_huber_c`` and the like; without a
    context, MSE) of the prediction (``outputs[0]``) to the velocity (``targets[0]``), weighted by ``targets[1]`` (a
    mask or per-element weights) when present."""
    return training_loss(outputs[0], targets[0], targets[1] if len(targets) > 1 else None, context)


def leading_tokens(outputs: Tensors, targets: Tensors) -> Tensors:
    """``outputs`` with the prediction cut to the target's tokens, its first ``targets[0].shape[1]``: an edit model
    appends its control (reference) images' tokens after the noisy target's, and the loss covers the target only."""
    return (outputs[0][:, : targets[0].shape[1]], *outputs[1:])
