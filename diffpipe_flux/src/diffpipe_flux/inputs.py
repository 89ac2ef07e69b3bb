"""Training inputs and loss: rectified flow matching on 2x2-packed Flux latents."""

from __future__ import annotations

import torch

from diffpipe_core import TrainingContext
from diffpipe_core.diffusion import flow_matching_pair, flux_resolution_shift, masked_mse, sample_timesteps
from diffpipe_flux.config import FluxConfig
from diffpipe_flux.packing import image_ids, pack, text_ids

Tensors = tuple[torch.Tensor, ...]


def time_shift(cfg: FluxConfig, latent_hw: tuple[int, int]) -> float:
    """``shift``, or with ``flux_shift`` Flux's resolution-dependent e^mu for this many image tokens."""
    if cfg.flux_shift:
        return flux_resolution_shift((latent_hw[0] // 2) * (latent_hw[1] // 2))
    return cfg.shift


def flux_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
    """``((x_t, t, t5_embeds, clip_pooled, guidance, img_ids, txt_ids), (target[, mask]))``, all packed.

    ``x_t = (1 - t) x + t noise`` and ``target = noise - x``; noise and t come from ``generator`` only.
    """
    cfg: FluxConfig = context.model_config  # type: ignore[assignment]
    latents = batch["latents"].float()
    b, c, h, w = latents.shape
    noise = torch.randn(latents.shape, generator=generator)
    t = sample_timesteps(
        b,
        generator,
        cfg.timestep_sample_method,
        cfg.sigmoid_scale,
        time_shift(cfg, (h, w)),
        quantile=context.eval_quantile,
    )
    x_t, target = flow_matching_pair(latents, noise, t)
    text = batch["t5_embeds"].float()
    guidance = torch.full((b,), float(cfg.guidance))
    inputs = (pack(x_t), t, text, batch["clip_pooled"].float(), guidance, image_ids(h, w), text_ids(text.shape[1]))
    targets: Tensors = (pack(target),)
    if "mask" in batch:
        targets += (pack(batch["mask"].float().expand(b, c, h, w).contiguous()),)
    return inputs, targets


def flux_loss(outputs: Tensors, targets: Tensors) -> torch.Tensor:
    return masked_mse(outputs[0], targets[0], targets[1] if len(targets) > 1 else None)
