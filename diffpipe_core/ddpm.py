"""Shared DDPM maths for UNet-style models (SD 1.x/2.x, SDXL, ...): noise schedules, zero-terminal-SNR
rescaling, noisy inputs, epsilon / v-prediction targets, and per-sample loss weights (min-SNR-gamma,
debiased estimation).

Timesteps are integers ``0 .. num_train_timesteps - 1``; ``alphas_cumprod`` is the cumulative product
of ``1 - beta`` over them (``alpha_bar`` in the papers). Everything here is pure torch and
deterministic given the generator it is handed.
"""

from __future__ import annotations

from typing import Literal

import torch

BetaSchedule = Literal["scaled_linear", "linear"]

#: What SD 1.x/2.x and SDXL were trained with (``scheduler/scheduler_config.json`` of their repos).
SD_BETA_START, SD_BETA_END, SD_NUM_TRAIN_TIMESTEPS = 0.00085, 0.012, 1000


def alphas_cumprod(
    num_train_timesteps: int = SD_NUM_TRAIN_TIMESTEPS,
    beta_start: float = SD_BETA_START,
    beta_end: float = SD_BETA_END,
    schedule: BetaSchedule = "scaled_linear",
    zero_terminal_snr: bool = False,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``alpha_bar_t`` for every integer timestep (float64), as diffusers' DDPMScheduler computes it (which does it
    in float32: pass ``dtype=torch.float32`` to get its values bit for bit).

    ``scaled_linear``: betas linear in sqrt space (``linspace(sqrt(b0), sqrt(b1)) ** 2``); ``linear``: linear.
    With ``zero_terminal_snr`` the schedule is rescaled so that the last timestep has SNR exactly 0
    (Lin et al. 2023, "Common Diffusion Noise Schedules and Sample Steps are Flawed", Algorithm 1).
    """
    if schedule == "scaled_linear":
        betas = torch.linspace(beta_start**0.5, beta_end**0.5, num_train_timesteps, dtype=dtype) ** 2
    elif schedule == "linear":
        betas = torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=dtype)
    else:
        raise ValueError(f"unknown beta schedule {schedule!r}; valid: 'scaled_linear', 'linear'")
    abar = torch.cumprod(1.0 - betas, dim=0)
    return rescale_zero_terminal_snr(abar) if zero_terminal_snr else abar


def rescale_zero_terminal_snr(abar: torch.Tensor) -> torch.Tensor:
    """Shift and scale ``sqrt(alpha_bar)`` so the last value is 0 and the first is unchanged (Lin et al. 2023)."""
    s = abar.double().sqrt()
    s0, s_last = s[0].clone(), s[-1].clone()
    s = (s - s_last) * s0 / (s0 - s_last)
    return s**2


def snr(abar_t: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio ``alpha_bar / (1 - alpha_bar)`` (0 at a zero-terminal-SNR last step)."""
    return abar_t / (1.0 - abar_t)


def sample_timesteps(
    n: int, generator: torch.Generator, num_train_timesteps: int = SD_NUM_TRAIN_TIMESTEPS, quantile: float | None = None
) -> torch.Tensor:
    """``n`` uniform integer timesteps in ``[0, num_train_timesteps)`` (int64). With ``quantile`` (evaluation),
    every sample gets that quantile of the same distribution instead."""
    if quantile is not None:
        t = min(int(float(quantile) * num_train_timesteps), num_train_timesteps - 1)
        return torch.full((n,), t, dtype=torch.long)
    return torch.randint(0, num_train_timesteps, (n,), generator=generator, dtype=torch.long)


def _bcast(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.view(-1, *([1] * (like.dim() - 1))).to(like.device, like.dtype)


def add_noise(latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, abar: torch.Tensor) -> torch.Tensor:
    """``x_t = sqrt(alpha_bar_t) * x_0 + sqrt(1 - alpha_bar_t) * noise``."""
    a = abar[t.cpu()]
    return _bcast(a.sqrt(), latents) * latents + _bcast((1 - a).sqrt(), latents) * noise


def v_target(latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, abar: torch.Tensor) -> torch.Tensor:
    """The v-prediction target ``v = sqrt(alpha_bar_t) * noise - sqrt(1 - alpha_bar_t) * x_0`` (Salimans & Ho)."""
    a = abar[t.cpu()]
    return _bcast(a.sqrt(), latents) * noise - _bcast((1 - a).sqrt(), latents) * latents


def min_snr_weight(snr_t: torch.Tensor, gamma: float, v_prediction: bool) -> torch.Tensor:
    """Min-SNR-gamma loss weight (Hang et al. 2023): ``min(snr, gamma) / snr`` for epsilon prediction,
    ``min(snr, gamma) / (snr + 1)`` for v-prediction. An SNR of 0 (zero-terminal-SNR) gives weight 1 for
    epsilon (the limit) and 0 for v."""
    clipped = torch.minimum(snr_t, torch.full_like(snr_t, float(gamma)))
    if v_prediction:
        return clipped / (snr_t + 1.0)
    return torch.where(snr_t > 0, clipped / snr_t.clamp_min(1e-20), torch.ones_like(snr_t))


def debiased_weight(snr_t: torch.Tensor, max_snr: float = 1000.0, min_snr: float = 1e-3) -> torch.Tensor:
    """Debiased estimation loss weight ``1 / sqrt(snr)`` (as kohya's sd-scripts), with the SNR clamped to
    ``[min_snr, max_snr]`` so the weight stays finite at both ends of the schedule."""
    return 1.0 / snr_t.clamp(min_snr, max_snr).sqrt()
