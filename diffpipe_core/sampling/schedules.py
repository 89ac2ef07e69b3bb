"""Sampling schedules and steps that several model plugins share (they call these, never copy them).

Time convention as in :mod:`diffpipe_core.diffusion`: ``sigma = 1`` is pure noise, ``sigma = 0`` the clean
latent, and a flow-matching model predicts the velocity ``noise - x``.
"""

from __future__ import annotations

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
