"""Training inputs and loss: rectified flow on packed LTX-Video latents, with first-frame conditioning.

``prepare_inputs`` gives the first pipeline layer ``(x_t, t, t5_embeds, t5_mask, grid)``:

- ``x_t`` ``(B, F*H*W, C)``: the packed noisy latents ``(1 - t) x + t noise``;
- ``t`` ``(B, F)``: each latent frame's flow time in [0, 1] (the transformer sees ``1000 t``, as LTXPipeline's
  scheduler timesteps); a first frame kept clean by ``first_frame_conditioning_p`` has ``t = 0``;
- ``t5_embeds`` ``(B, L, d)`` and ``t5_mask`` ``(B, L)`` bool;
- ``grid`` int64 ``(3,)``: the latent ``(F, H, W)``, for the rotary position embedding.

and the loss ``(target, weight)``: the velocity ``noise - x`` packed, and a ``(B, F*H*W, 1)`` weight that is 0 on
conditioned first frames (times the dataset's loss mask when it has one).
"""

from __future__ import annotations

import torch

from diffpipe_core import TrainingContext
from diffpipe_core.diffusion import flow_matching_pair, flux_resolution_shift, masked_mse, sample_timesteps
from diffpipe_ltx.config import LTXConfig
from diffpipe_ltx.loading import shift_constants
from diffpipe_ltx.packing import pack

Tensors = tuple[torch.Tensor, ...]


def time_shift(cfg: LTXConfig, tokens: int) -> float:
    """``shift``, or with ``resolution_shift`` LTXPipeline's e^mu for this many latent tokens."""
    if cfg.resolution_shift:
        base_len, max_len, base_shift, max_shift = shift_constants(cfg)
        return flux_resolution_shift(tokens, base_len, max_len, base_shift, max_shift)
    return cfg.shift


def ltx_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
    """``((x_t, t, t5_embeds, t5_mask, grid), (target, weight))``; all randomness from ``generator``."""
    cfg: LTXConfig = context.model_config  # type: ignore[assignment]
    latents = batch["latents"].float()
    b, _, f, h, w = latents.shape
    noise = torch.randn(latents.shape, generator=generator)
    t = sample_timesteps(
        b,
        generator,
        cfg.timestep_sample_method,
        cfg.sigmoid_scale,
        time_shift(cfg, f * h * w),
        quantile=context.eval_quantile,
    )
    draw = torch.rand(b, generator=generator)  # drawn always, so p does not change the other draws
    conditioned = (draw < cfg.first_frame_conditioning_p) & (f > 1) & (context.eval_quantile is None)
    x_t, target = flow_matching_pair(latents, noise, t)
    x_t[conditioned, :, 0] = latents[conditioned, :, 0]  # t = 0 on that frame: exactly the clean latents
    frame_t = t[:, None].repeat(1, f)
    frame_t[conditioned, 0] = 0.0
    weight = torch.ones(b, 1, f, h, w)
    weight[conditioned, :, 0] = 0.0
    if "mask" in batch:
        weight = weight * batch["mask"].float()[:, :, None]
    grid = torch.tensor([f, h, w], dtype=torch.long)
    inputs = (pack(x_t), frame_t, batch["t5_embeds"].float(), batch["t5_mask"].bool(), grid)
    return inputs, (pack(target), pack(weight))


def ltx_loss(outputs: Tensors, targets: Tensors) -> torch.Tensor:
    """Weighted MSE to the velocity (conditioned first frames and masked-out pixels weigh 0)."""
    return masked_mse(outputs[0], targets[0], targets[1])
