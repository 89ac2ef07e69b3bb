"""Training inputs and losses of the two Cosmos generations, from the core's shared maths.

Cosmos-1.0 (EDM, :mod:`diffpipe_core.edm`): ``log sigma ~ N(p_mean, p_std)``, ``x = x_0 + sigma * noise``; the
transformer sees ``c_in * x`` at timestep ``c_noise``, the denoiser is ``D = c_skip * x + c_out * F`` and the loss
``(sigma^2 + sigma_data^2) / (sigma * sigma_data)^2 * |D - x_0|^2``.

Cosmos-Predict2 (rectified flow, :mod:`diffpipe_core.diffusion`): NVIDIA states it in EDM terms with
sigma_data = 1, but its pipeline feeds the transformer ``x_sigma / (1 + sigma)`` at timestep ``t = sigma / (1 + sigma)``
and forms ``D = (1 - t) * x_sigma - t * F``. With ``x_t = (1 - t) x_0 + t * noise`` that is ``D = x_t - t * F``: the
transformer is a rectified-flow velocity model (``F = noise - x_0`` gives ``D = x_0``), and NVIDIA's EDM weight
times ``|D - x_0|^2`` is ``(t^2 + (1 - t)^2) * |F - (noise - x_0)|^2`` (``nvidia_weighting``).
"""

from __future__ import annotations

import torch

from diffpipe_core import TrainingContext, edm
from diffpipe_core.diffusion import flow_matching_pair, sample_timesteps
from diffpipe_cosmos.config import Cosmos1Config, Predict2Config

Tensors = tuple[torch.Tensor, ...]


def _mask(batch: dict[str, torch.Tensor]) -> Tensors:
    return (batch["mask"].float(),) if "mask" in batch else ()


def cosmos1_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
    """``((c_in * x, c_noise, t5_embeds), (x_0, x, sigma, sigma_data[, mask]))``; noise and sigma from ``generator``."""
    cfg: Cosmos1Config = context.model_config  # type: ignore[assignment]
    latents = batch["latents"].float()
    b = latents.shape[0]
    noise = torch.randn(latents.shape, generator=generator)
    sigma = edm.sample_sigmas(b, generator, cfg.p_mean, cfg.p_std, quantile=context.eval_quantile)
    x = edm.noisy(latents, noise, sigma)
    pre = edm.preconditioning(sigma, cfg.sigma_data)
    model_in = pre.c_in.view(-1, 1, 1, 1, 1) * x
    targets: Tensors = (latents, x, sigma, torch.full((b,), cfg.sigma_data)) + _mask(batch)
    return (model_in, pre.c_noise, batch["t5_embeds"].float()), targets


def cosmos1_loss(outputs: Tensors, targets: Tensors) -> torch.Tensor:
    latents, x, sigma, sigma_data = targets[:4]
    mask = targets[4] if len(targets) > 4 else None
    return edm.edm_loss(outputs[0], x, latents, sigma, float(sigma_data[0]), mask)


def nvidia_weight(t: torch.Tensor) -> torch.Tensor:
    """``t^2 + (1 - t)^2``: Predict2's EDM loss weight (sigma_data 1) in rectified-flow time (module docstring)."""
    return t**2 + (1 - t) ** 2


def predict2_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
    """``((x_t, t, t5_embeds), (noise - x_0, weight[, mask]))``; noise and t from ``generator``. ``weight`` is
    :func:`nvidia_weight` with ``nvidia_weighting``, else ones."""
    cfg: Predict2Config = context.model_config  # type: ignore[assignment]
    latents = batch["latents"].float()
    b = latents.shape[0]
    noise = torch.randn(latents.shape, generator=generator)
    t = sample_timesteps(
        b, generator, cfg.timestep_sample_method, cfg.sigmoid_scale, cfg.shift, quantile=context.eval_quantile
    )
    x_t, target = flow_matching_pair(latents, noise, t)
    weight = nvidia_weight(t) if cfg.nvidia_weighting else torch.ones(b)
    return (x_t, t, batch["t5_embeds"].float()), (target, weight) + _mask(batch)


def predict2_loss(outputs: Tensors, targets: Tensors) -> torch.Tensor:
    target, weight = targets[:2]
    mask = targets[2] if len(targets) > 2 else None
    return edm.weighted_mse(outputs[0], target, weight, mask)
