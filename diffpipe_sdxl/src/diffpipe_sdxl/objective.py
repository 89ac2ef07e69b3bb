"""The SDXL training objective: DDPM noising with uniform integer timesteps, epsilon or v-prediction
targets, per-sample loss weights (min-SNR-gamma, debiased estimation), noise offset, masked MSE.
The maths lives in :mod:`diffpipe_core.ddpm` and :mod:`diffpipe_core.diffusion`."""

from __future__ import annotations

from functools import lru_cache

import torch

from diffpipe_core import TrainingContext, ddpm
from diffpipe_core.diffusion import masked_mse
from diffpipe_sdxl.config import SDXLConfig

Tensors = tuple[torch.Tensor, ...]


@lru_cache(maxsize=8)
def schedule(num_train_timesteps: int, beta_start: float, beta_end: float, zero_terminal_snr: bool) -> torch.Tensor:
    """``alpha_bar`` per timestep for the configured schedule (cached)."""
    return ddpm.alphas_cumprod(num_train_timesteps, beta_start, beta_end, "scaled_linear", zero_terminal_snr)


def loss_weights(cfg: SDXLConfig, abar: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Per-sample weights: 1, times min-SNR-gamma and/or debiased estimation when configured."""
    snr_t = ddpm.snr(abar[t])
    weights = torch.ones_like(snr_t)
    if cfg.min_snr_gamma is not None:
        weights = weights * ddpm.min_snr_weight(snr_t, cfg.min_snr_gamma, cfg.v_pred)
    if cfg.debiased_estimation:
        weights = weights * ddpm.debiased_weight(snr_t)
    return weights.float()


def prepare_inputs(
    batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator
) -> tuple[Tensors, Tensors]:
    """Inputs ``(x_t, t, text_embeds, text_mask, pooled, time_ids)``; targets ``(target, weights[, mask])``."""
    cfg: SDXLConfig = context.model_config  # type: ignore[assignment]
    latents = batch["latents"].float()
    b, c = latents.shape[:2]
    noise = torch.randn(latents.shape, generator=generator)
    if cfg.noise_offset:
        noise = noise + cfg.noise_offset * torch.randn((b, c, 1, 1), generator=generator)
    t = ddpm.sample_timesteps(b, generator, cfg.num_train_timesteps, quantile=context.eval_quantile)
    abar = schedule(cfg.num_train_timesteps, cfg.beta_start, cfg.beta_end, cfg.zero_terminal_snr)
    x_t = ddpm.add_noise(latents, noise, t, abar)
    target = ddpm.v_target(latents, noise, t, abar) if cfg.v_pred else noise
    inputs = (
        x_t,
        t,
        batch["text_embeds"].float(),
        batch["text_mask"].bool(),
        batch["pooled"].float(),
        batch["time_ids"].float(),
    )
    targets = (target, loss_weights(cfg, abar, t))
    if "mask" in batch:
        targets += (batch["mask"].float(),)
    return inputs, targets


def compute_loss(outputs: Tensors, targets: Tensors) -> torch.Tensor:
    """Weighted, masked MSE: ``mean(w_b * mask * (pred - target)^2) / mean(mask)``."""
    pred, target, weights = outputs[0], targets[0], targets[1]
    mask = targets[2] if len(targets) > 2 else None
    scale = weights.to(pred.device).sqrt().view(-1, *([1] * (pred.dim() - 1)))  # w * err^2 = (sqrt(w) * err)^2
    return masked_mse(pred.float() * scale, target.float() * scale, mask)
