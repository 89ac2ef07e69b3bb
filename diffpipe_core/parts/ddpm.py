"""The one DDPM input/loss builder of UNet-style models (SD 1.x/2.x, SDXL): noise (plus a per-channel noise offset),
then uniform integer timesteps, drawn in that order from the micro-batch's generator; ``x_t``; the epsilon or v target;
and per-sample loss weights (min-SNR-gamma, debiased estimation). The maths is :mod:`diffpipe_core.ddpm`'s."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from diffpipe_core import ddpm
from diffpipe_core.diffusion import masked_mse
from diffpipe_core.parts.flow import Tensors

if TYPE_CHECKING:
    from diffpipe_core.parts.config import DDPMConfig
    from diffpipe_core.types import TrainingContext


@dataclass
class DDPMSample:
    """``x_t`` at the integer timesteps ``t``, the ``target`` (noise or v) and the per-sample loss ``weights``."""

    x_t: torch.Tensor
    t: torch.Tensor
    target: torch.Tensor
    weights: torch.Tensor


@lru_cache(maxsize=8)
def schedule(num_train_timesteps: int, beta_start: float, beta_end: float, zero_terminal_snr: bool) -> torch.Tensor:
    """``alpha_bar`` per timestep of a scaled-linear schedule (cached)."""
    return ddpm.alphas_cumprod(num_train_timesteps, beta_start, beta_end, "scaled_linear", zero_terminal_snr)


def config_schedule(cfg: DDPMConfig) -> torch.Tensor:
    """``alpha_bar`` of the configured schedule."""
    return schedule(cfg.num_train_timesteps, cfg.beta_start, cfg.beta_end, cfg.zero_terminal_snr)


def loss_weights(cfg: DDPMConfig, abar: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Per-sample weights: 1, times min-SNR-gamma and/or debiased estimation when configured."""
    snr_t = ddpm.snr(abar[t])
    weights = torch.ones_like(snr_t)
    if cfg.min_snr_gamma is not None:
        weights = weights * ddpm.min_snr_weight(snr_t, cfg.min_snr_gamma, cfg.v_pred)
    if cfg.debiased_estimation:
        weights = weights * ddpm.debiased_weight(snr_t)
    return weights.float()


def ddpm_sample(
    latents: torch.Tensor, cfg: DDPMConfig, context: TrainingContext, generator: torch.Generator
) -> DDPMSample:
    """Noise, timesteps, ``x_t``, target and weights for one micro-batch of ``(B, C, ...)`` latents. While evaluating
    (``context.eval_quantile``) every sample gets that quantile of the timesteps."""
    latents = latents.float()
    b, c = latents.shape[:2]
    noise = torch.randn(latents.shape, generator=generator)
    if cfg.noise_offset:
        noise = noise + cfg.noise_offset * torch.randn((b, c, *([1] * (latents.dim() - 2))), generator=generator)
    t = ddpm.sample_timesteps(b, generator, cfg.num_train_timesteps, quantile=context.eval_quantile)
    abar = config_schedule(cfg)
    x_t = ddpm.add_noise(latents, noise, t, abar)
    target = ddpm.v_target(latents, noise, t, abar) if cfg.v_pred else noise
    return DDPMSample(x_t, t, target, loss_weights(cfg, abar, t))


def ddpm_loss(outputs: Tensors, targets: Tensors) -> torch.Tensor:
    """Weighted, masked MSE of ``targets = (target, weights[, mask])``: ``mean(w_b * mask * (pred - target)^2) /
    mean(mask)``."""
    pred, target, weights = outputs[0], targets[0], targets[1]
    mask = targets[2] if len(targets) > 2 else None
    scale = weights.to(pred.device).sqrt().view(-1, *([1] * (pred.dim() - 1)))  # w * err^2 = (sqrt(w) * err)^2
    return masked_mse(pred.float() * scale, target.float() * scale, mask)
