"""Training inputs and loss: rectified flow matching on HunyuanVideo's video latents."""

from __future__ import annotations

import torch

from diffpipe_core import TrainingContext
from diffpipe_core.diffusion import flow_matching_pair, masked_mse, sample_timesteps
from diffpipe_hunyuan.config import HunyuanConfig

Tensors = tuple[torch.Tensor, ...]


def hunyuan_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
    """``((x_t, t, text_embeds, text_mask, clip_pooled, guidance), (target[, mask]))``.

    Latents are ``(B, C, F, h, w)`` (images: F = 1). ``x_t = (1 - t) x + t noise`` and ``target = noise - x``;
    noise and t come from ``generator`` only. ``guidance`` is the configured guidance-embedding value.
    """
    cfg: HunyuanConfig = context.model_config  # type: ignore[assignment]
    latents = batch["latents"].float()
    b = latents.shape[0]
    noise = torch.randn(latents.shape, generator=generator)
    t = sample_timesteps(
        b, generator, cfg.timestep_sample_method, cfg.sigmoid_scale, cfg.shift, quantile=context.eval_quantile
    )
    x_t, target = flow_matching_pair(latents, noise, t)
    guidance = torch.full((b,), float(cfg.guidance))
    inputs = (x_t, t, batch["text_embeds"].float(), batch["text_mask"].long(), batch["clip_pooled"].float(), guidance)
    targets: Tensors = (target,)
    if "mask" in batch:
        targets += (batch["mask"].float(),)
    return inputs, targets


def hunyuan_loss(outputs: Tensors, targets: Tensors) -> torch.Tensor:
    return masked_mse(outputs[0], targets[0], targets[1] if len(targets) > 1 else None)
