"""Shared diffusion maths: timestep sampling, shifts, flow-matching inputs and targets, first-frame conditioning,
the training loss.

Plugins call these instead of re-implementing them.

Time convention: ``t`` is a float in (0, 1) per sample; ``t = 0`` is the clean latent and ``t = 1`` pure
noise (rectified flow: ``x_t = (1 - t) * x + t * noise``, velocity target ``noise - x``). A model that
expects diffusers' 0-1000 timesteps scales ``t`` in its own layers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

if TYPE_CHECKING:
    from diffpipe_core.types import TrainingContext

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


class FirstFrameConditioned(NamedTuple):
    """What :func:`first_frame_conditioning` returns."""

    x_t: torch.Tensor  # (B, C, F, H, W): the noisy latents, with a conditioned sample's first frame clean
    frame_t: torch.Tensor  # (B, F): each latent frame's time, 0 on a conditioned first frame
    weight: torch.Tensor  # (B, 1, F, H, W) float32 loss weight: 0 on a conditioned first frame, else 1
    conditioned: torch.Tensor  # (B,) bool: which samples are conditioned


def first_frame_conditioning(
    latents: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, p: float, generator: torch.Generator,
    evaluating: bool = False,
) -> FirstFrameConditioned:
    """Image-to-video training on a video model's own latents (LTX-Video's ``first_frame_conditioning_p``): with
    probability ``p`` per sample, the first latent frame stays clean (``x_t`` there equals ``latents``, its time is 0)
    and the loss ignores it, so the model learns to continue a given first frame.

    ``latents`` and ``x_t`` are ``(B, C, F, H, W)`` (``x_t`` from :func:`flow_matching_pair`; not modified), ``t``
    the ``(B,)`` times. Draws exactly one ``torch.rand(B, generator=generator)``, always, whatever ``p`` (so ``p``
    does not change later draws): call it after drawing the noise and ``t``, as LTX-Video does. Nothing is
    conditioned when ``evaluating`` (held-out data: ``context.eval_quantile is not None``) or for single-frame
    latents (images). Multiply the loss mask by ``weight`` (:func:`masked_mse` takes it as the mask).
    """
    b, _, f, h, w = latents.shape
    draw = torch.rand(b, generator=generator)
    conditioned = (draw < p) & (f > 1) & (not evaluating)
    x_t = x_t.clone()
    x_t[conditioned, :, 0] = latents[conditioned, :, 0]  # t = 0 on that frame: exactly the clean latents
    frame_t = t[:, None].repeat(1, f)
    frame_t[conditioned, 0] = 0.0
    weight = torch.ones(b, 1, f, h, w, device=latents.device)
    weight[conditioned, :, 0] = 0.0
    return FirstFrameConditioned(x_t, frame_t, weight, conditioned)


def masked_mean(err: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean of ``err``; with ``mask`` (broadcastable to ``err``), the mask-weighted mean."""
    if mask is None:
        return err.mean()
    mask = mask.float().expand_as(err)
    return (err * mask).sum() / mask.sum().clamp_min(1e-8)


def masked_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error in float32; with ``mask`` (broadcastable to ``pred``), a mask-weighted mean."""
    return masked_mean((pred.float() - target.float()) ** 2, mask)


def training_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None = None,
    context: TrainingContext | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss ``compute_loss`` returns: the run's elementwise loss in float32, mask-weighted like :func:`masked_mse`.

    The elementwise loss is ``context.loss`` (run.toml's ``pseudo_huber_c``, ``huber_delta`` or ``smooth_l1_beta``;
    squared error when none is set, or without a context, which is exactly :func:`masked_mse`). ``weights`` (one per
    sample, e.g. min-SNR) scale each sample's elementwise loss before the mean.
    """
    import torch.nn.functional as F

    settings = context.loss if context is not None else None
    if weights is None and (settings is None or settings.is_mse):
        return masked_mse(pred, target, mask)
    pred, target = pred.float(), target.float()
    if settings is None or settings.is_mse:
        err = (pred - target) ** 2
    elif settings.pseudo_huber_c is not None:
        c = float(settings.pseudo_huber_c)
        err = torch.sqrt((pred - target) ** 2 + c * c) - c
    elif settings.huber_delta is not None:
        err = F.huber_loss(pred, target, reduction="none", delta=float(settings.huber_delta))
    else:
        err = F.smooth_l1_loss(pred, target, reduction="none", beta=float(settings.smooth_l1_beta))
    if weights is not None:
        err = err * weights.to(err.device, torch.float32).view(-1, *([1] * (err.dim() - 1)))
    if mask is None:
        return err.mean()
    mask = mask.float().expand_as(err)
    return (err * mask).sum() / mask.sum().clamp_min(1e-8)
