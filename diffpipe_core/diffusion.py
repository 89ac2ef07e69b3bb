"""Shared diffusion maths: timestep sampling, shifts, flow-matching inputs and targets, masked MSE.

Plugins call these instead of re-implementing them.

Time convention: ``t`` is a float in (0, 1) per sample; ``t = 0`` is the clean latent and ``t = 1`` pure
noise (rectified flow: ``x_t = (1 - t) * x + t * noise``, velocity target ``noise - x``). A model that
expects diffusers' 0-1000 timesteps scales ``t`` in its own layers.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

TimestepMethod = Literal["logit_normal", "uniform"]


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3/Flux time shift: ``t' = shift*t / (1 + (shift-1)*t)``; ``shift=1`` is the identity."""
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


def flux_resolution_shift(
    image_seq_len: int, base_len: int = 256, max_len: int = 4096, base_shift: float = 0.5, max_shift: float = 1.15
) -> float:
    """Flux's resolution-dependent shift: ``mu`` is linear in the image token count, shift = e^mu."""
    slope = (max_shift - base_shift) / (max_len - base_len)
    mu = base_shift + slope * (image_seq_len - base_len)
    return math.exp(mu)


def sample_timesteps(
    n: int,
    generator: torch.Generator,
    method: TimestepMethod = "logit_normal",
    sigmoid_scale: float = 1.0,
    shift: float = 1.0,
    device: torch.device | str = "cpu",
    quantile: float | None = None,
) -> torch.Tensor:
    """Draw ``n`` flow-matching times in (0, 1).

    ``logit_normal``: ``sigmoid(sigmoid_scale * N(0, 1))``; ``uniform``: U(0, 1). Then the time shift.
    With ``quantile`` (evaluation), every sample gets that quantile of the same distribution instead.
    """
    if quantile is not None:
        q = torch.full((n,), float(quantile))
        if method == "logit_normal":
            t = torch.sigmoid(sigmoid_scale * math.sqrt(2.0) * torch.erfinv(2 * q - 1))
        elif method == "uniform":
            t = q
        else:
            raise ValueError(f"unknown timestep_sample_method {method!r}; valid: 'logit_normal', 'uniform'")
        return shift_timesteps(t, shift).to(device)
    if method == "logit_normal":
        t = torch.sigmoid(sigmoid_scale * torch.randn(n, generator=generator))
    elif method == "uniform":
        t = torch.rand(n, generator=generator)
    else:
        raise ValueError(f"unknown timestep_sample_method {method!r}; valid: 'logit_normal', 'uniform'")
    return shift_timesteps(t, shift).to(device)


def flow_matching_pair(
    latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rectified flow: ``x_t = (1 - t) * x + t * noise`` and the velocity target ``noise - x``."""
    t_b = t.view(-1, *([1] * (latents.dim() - 1))).to(latents.dtype)
    x_t = (1 - t_b) * latents + t_b * noise
    return x_t, noise - latents


def masked_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error in float32; with ``mask`` (broadcastable to ``pred``), a mask-weighted mean."""
    err = (pred.float() - target.float()) ** 2
    if mask is None:
        return err.mean()
    mask = mask.float().expand_as(err)
    return (err * mask).sum() / mask.sum().clamp_min(1e-8)
