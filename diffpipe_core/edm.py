"""Shared EDM maths (Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative Models"):
noise-level sampling, the preconditioning coefficients, the noisy input and the loss weight.

A model ``F`` is wrapped as the denoiser ``D(x; sigma) = c_skip * x + c_out * F(c_in * x, c_noise)``, trained
on ``x = x_0 + sigma * noise`` to reproduce ``x_0`` with the loss ``weight(sigma) * |D(x; sigma) - x_0|^2``.
``weight * c_out^2 = 1``, so every noise level contributes equally to the gradient of ``F``. Pure torch,
deterministic given the generator it is handed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from diffpipe_core.diffusion import masked_mean


@dataclass(frozen=True)
class Preconditioning:
    """The EDM coefficients at noise levels ``sigma`` (each a tensor shaped like ``sigma``)."""

    c_skip: torch.Tensor
    c_out: torch.Tensor
    c_in: torch.Tensor
    c_noise: torch.Tensor


def sample_sigmas(
    n: int, generator: torch.Generator, p_mean: float = -1.2, p_std: float = 1.2, quantile: float | None = None
) -> torch.Tensor:
    """``n`` noise levels with ``log sigma ~ N(p_mean, p_std)`` (float32). With ``quantile`` (evaluation), every
    sample gets that quantile of the same distribution instead."""
    if quantile is not None:
        z = math.sqrt(2.0) * torch.erfinv(torch.full((n,), 2 * float(quantile) - 1))
    else:
        z = torch.randn(n, generator=generator)
    return torch.exp(p_mean + p_std * z)


def preconditioning(sigma: torch.Tensor, sigma_data: float = 0.5) -> Preconditioning:
    """``c_skip = sd^2 / (s^2 + sd^2)``, ``c_out = s * sd / sqrt(s^2 + sd^2)``, ``c_in = 1 / sqrt(s^2 + sd^2)``,
    ``c_noise = log(s) / 4`` (EDM Table 1; ``c_noise`` is what diffusers' EDM schedulers feed the model)."""
    sigma = sigma.double()
    total = sigma**2 + sigma_data**2
    return Preconditioning(
        c_skip=(sigma_data**2 / total).float(),
        c_out=(sigma * sigma_data / total.sqrt()).float(),
        c_in=(1.0 / total.sqrt()).float(),
        c_noise=(0.25 * sigma.log()).float(),
    )


def loss_weight(sigma: torch.Tensor, sigma_data: float = 0.5) -> torch.Tensor:
    """``lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma * sigma_data)^2`` = ``1 / c_out^2``."""
    sigma = sigma.double()
    return ((sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2).float()


@dataclass(frozen=True)
class EdmSample:
    """One micro-batch's training draw: ``x = x_0 + sigma * noise``, the per-sample ``sigma``, the noise and the
    preconditioning at ``sigma``."""

    x: torch.Tensor
    sigma: torch.Tensor
    noise: torch.Tensor
    pre: Preconditioning


def edm_sample(
    latents: torch.Tensor,
    generator: torch.Generator,
    p_mean: float,
    p_std: float,
    sigma_data: float = 0.5,
    quantile: float | None = None,
) -> EdmSample:
    """Noise and then the noise levels (this order, from ``generator``) for ``latents`` (float32, batch first);
    ``quantile``: every sample at that quantile of the level distribution (evaluation)."""
    latents = latents.float()
    noise = torch.randn(latents.shape, generator=generator)
    sigma = sample_sigmas(latents.shape[0], generator, p_mean, p_std, quantile=quantile)
    return EdmSample(noisy(latents, noise, sigma), sigma, noise, preconditioning(sigma, sigma_data))


def _bcast(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.view(-1, *([1] * (like.dim() - 1))).to(like.device, like.dtype)


def noisy(latents: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``x = x_0 + sigma * noise`` (``sigma`` one value per sample)."""
    return latents + _bcast(sigma, latents) * noise


def denoise(model_output: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor, sigma_data: float = 0.5) -> torch.Tensor:
    """The denoiser ``D = c_skip * x + c_out * F`` in float32, from the raw model output ``F``."""
    pre = preconditioning(sigma, sigma_data)
    x32 = x.float()
    return _bcast(pre.c_skip, x32) * x32 + _bcast(pre.c_out, x32) * model_output.float()


def weighted_mse(
    pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``mean(weight * (pred - target)^2)`` in float32 with one ``weight`` per sample; with ``mask``
    (broadcastable to ``pred``), the mask-weighted mean instead of the plain mean."""
    err = (pred.float() - target.float()) ** 2
    return masked_mean(err * _bcast(weight.float(), err), mask)


def edm_loss(
    model_output: torch.Tensor,
    x: torch.Tensor,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    sigma_data: float = 0.5,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``mean(weight(sigma) * (D - x_0)^2)`` in float32; with ``mask`` (broadcastable), a mask-weighted mean."""
    return weighted_mse(denoise(model_output, x, sigma, sigma_data), latents, loss_weight(sigma, sigma_data), mask)
