"""Sampling schedules and steps that several model plugins share (they call these, never copy them).

Time convention as in :mod:`diffpipe_core.diffusion`: ``sigma = 1`` is pure noise, ``sigma = 0`` the clean
latent, and a flow-matching model predicts the velocity ``noise - x``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from diffpipe_core.diffusion import shift_timesteps


def flow_sigmas(steps: int, shift: float = 1.0) -> torch.Tensor:
    """``steps + 1`` float32 sigmas: ``linspace(1, 1/steps, steps)`` time-shifted, then a final 0.

    This is the schedule ``FluxPipeline`` hands ``FlowMatchEulerDiscreteScheduler`` (its resolution-dependent
    ``mu`` is ``shift = e^mu`` here: the exponential time shift with exponent 1 equals the SD3 shift).
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    sigmas = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64).float()
    sigmas = shift_timesteps(sigmas, shift).float()
    return torch.cat([sigmas, torch.zeros(1)])


def flow_euler_step(latents: torch.Tensor, velocity: torch.Tensor, sigmas: torch.Tensor, index: int) -> torch.Tensor:
    """One Euler step of a flow-matching ODE from ``sigmas[index]`` to ``sigmas[index + 1]``, in float32
    (as ``FlowMatchEulerDiscreteScheduler.step`` computes it)."""
    dt = (sigmas[index + 1] - sigmas[index]).float()
    return latents.float() + dt.to(latents.device) * velocity.float().to(latents.device)


def scheduler_flow_sigmas(model_path: Path, base_sigmas: Any, image_seq_len: int | None = None) -> torch.Tensor:
    """The sigmas (a final 0 appended) that the model folder's own ``FlowMatchEulerDiscreteScheduler``
    (``scheduler/scheduler_config.json``) makes of ``base_sigmas``, exactly as its pipeline's ``retrieve_timesteps``
    does: its fixed or resolution-dependent shift (``mu`` from ``image_seq_len`` and the config's constants, as the
    pipelines' ``calculate_shift``) and ``shift_terminal`` stretching. Float32."""
    import json

    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    file = Path(model_path) / "scheduler" / "scheduler_config.json"
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(json.loads(file.read_text()) if file.is_file() else {})
    mu = None
    if scheduler.config.use_dynamic_shifting:
        c = scheduler.config
        slope = (c.get("max_shift", 1.15) - c.get("base_shift", 0.5)) / (
            c.get("max_image_seq_len", 4096) - c.get("base_image_seq_len", 256)
        )
        mu = image_seq_len * slope + (c.get("base_shift", 0.5) - slope * c.get("base_image_seq_len", 256))
    scheduler.set_timesteps(sigmas=np.asarray(base_sigmas), mu=mu, device="cpu")
    return scheduler.sigmas.float()


def karras_sigmas(
    steps: int, sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0, final_zero: bool = False
) -> torch.Tensor:
    """``steps + 1`` float32 EDM noise levels: Karras et al.'s ramp from ``sigma_max`` down to ``sigma_min``
    (computed in float64), then ``sigma_min`` again (``final_sigmas_type="sigma_min"``: the last step only
    re-evaluates the model, as ``EDMEulerScheduler`` and the Cosmos pipelines do), or 0 with ``final_zero``."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    ramp = torch.linspace(0, 1, steps, dtype=torch.float64)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    sigmas = ((hi + ramp * (lo - hi)) ** rho).float()
    return torch.cat([sigmas, torch.zeros(1) if final_zero else sigmas[-1:]])


def edm_euler_step(latents: torch.Tensor, denoised: torch.Tensor, sigmas: torch.Tensor, index: int) -> torch.Tensor:
    """One Euler step of the EDM probability-flow ODE from ``sigmas[index]`` to ``sigmas[index + 1]`` given the
    denoiser's output, in float32: ``x + (x - D) / sigma * (sigma_next - sigma)`` (``EDMEulerScheduler.step`` without
    churn; the Cosmos-Predict2 pipelines' epsilon step)."""
    sigma, sigma_next = sigmas[index].float(), sigmas[index + 1].float()
    x = latents.float()
    return x + (x - denoised.float().to(x.device)) / sigma * (sigma_next - sigma)
