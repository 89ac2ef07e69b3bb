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


def scheduler_flow_sigmas(
    model_path: Path, base_sigmas: Any, image_seq_len: int | None = None, mu: float | None = None
) -> torch.Tensor:
    """The sigmas (a final 0 appended) that the model folder's own ``FlowMatchEulerDiscreteScheduler``
    (``scheduler/scheduler_config.json``) makes of ``base_sigmas``, exactly as its pipeline's ``retrieve_timesteps``
    does: its fixed or resolution-dependent shift (``mu`` from ``image_seq_len`` and the config's constants, as the
    pipelines' ``calculate_shift``; or the given ``mu``, as a distilled checkpoint's pipeline fixes it) and
    ``shift_terminal`` stretching. Float32."""
    import json

    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    file = Path(model_path) / "scheduler" / "scheduler_config.json"
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(json.loads(file.read_text()) if file.is_file() else {})
    if mu is None and scheduler.config.use_dynamic_shifting:
        c = scheduler.config
        slope = (c.get("max_shift", 1.15) - c.get("base_shift", 0.5)) / (
            c.get("max_image_seq_len", 4096) - c.get("base_image_seq_len", 256)
        )
        mu = image_seq_len * slope + (c.get("base_shift", 0.5) - slope * c.get("base_image_seq_len", 256))
    scheduler.set_timesteps(sigmas=np.asarray(base_sigmas), mu=mu, device="cpu")
    return scheduler.sigmas.float()


def scheduler_sigmas(model_path: Path, steps: int) -> torch.Tensor:
    """The ``steps + 1`` sigmas (its final 0 included) of the model folder's own scheduler, of the class its
    ``scheduler/scheduler_config.json`` names (``FlowMatchEulerDiscreteScheduler``, ``UniPCMultistepScheduler`` with
    flow sigmas, ...), after ``set_timesteps(steps)`` with its default spacing and shift: the schedule a pipeline that
    calls ``scheduler.set_timesteps(num_inference_steps)`` (Wan's) steps through. Float32."""
    return _folder_scheduler(model_path, steps)[1]


def _folder_scheduler(model_path: Path, steps: int) -> tuple[Any, torch.Tensor]:
    import json

    import diffusers

    file = Path(model_path) / "scheduler" / "scheduler_config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: not found; sampling reads the model folder's scheduler settings from it")
    config = json.loads(file.read_text())
    cls = getattr(diffusers, str(config.get("_class_name")), None)
    if cls is None or not hasattr(cls, "set_timesteps"):
        raise ValueError(f"{file}: _class_name {config.get('_class_name')!r} is not a diffusers scheduler")
    scheduler = cls.from_config(config)
    scheduler.set_timesteps(steps, device="cpu")
    sigmas = torch.as_tensor(scheduler.sigmas).float()
    if len(sigmas) != steps + 1:
        raise ValueError(f"{file}: {cls.__name__} made {len(sigmas)} sigmas for {steps} steps; expected {steps + 1}")
    return scheduler, sigmas


def stepped_schedule(model_path: Path, steps: int) -> torch.Tensor:
    """:func:`scheduler_sigmas`, carrying the scheduler that made them (a fresh one per call) for
    :func:`scheduler_step`. A multistep solver (``UniPCMultistepScheduler``, DPM-Solver++) combines the model outputs
    of earlier steps, so only its own ``step`` takes the steps its pipeline takes; the schedule tensor is the state
    the sampling hooks carry from ``denoise_init`` to every ``denoise_step`` of one sample."""
    scheduler, sigmas = _folder_scheduler(model_path, steps)
    sigmas.diffpipe_scheduler = scheduler
    return sigmas


def scheduler_step(latents: torch.Tensor, prediction: torch.Tensor, schedule: torch.Tensor, index: int) -> torch.Tensor:
    """Step ``index`` of the folder's scheduler that :func:`stepped_schedule` attached to ``schedule``: its ``step``
    from ``schedule[index]`` to ``schedule[index + 1]`` on float32 latents (what its pipeline's loop calls, with
    the prediction the model makes of them)."""
    scheduler = getattr(schedule, "diffpipe_scheduler", None)
    if scheduler is None:
        raise ValueError("scheduler_step needs the schedule stepped_schedule made (it carries the scheduler's state)")
    if index != (scheduler.step_index or 0):
        raise ValueError(f"scheduler_step: step {index} out of order (the scheduler is at step {scheduler.step_index})")
    timestep = scheduler.timesteps[index]
    return scheduler.step(prediction.float(), timestep, latents.float(), return_dict=False)[0]


def schedule_time(schedule: torch.Tensor, index: int) -> torch.Tensor:
    """The flow time in [0, 1] the model is given at step ``index``: the timestep of the scheduler
    :func:`stepped_schedule` attached over its ``num_train_timesteps`` (UniPC rounds its timesteps to integers, and its
    pipeline gives the model those), else ``schedule[index]``."""
    scheduler = getattr(schedule, "diffpipe_scheduler", None)
    if scheduler is None:
        return schedule[index]
    return scheduler.timesteps[index].float() / float(scheduler.config.num_train_timesteps)


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


SPACINGS = ("leading", "trailing", "linspace")


def ddpm_sigmas(
    alphas_cumprod: torch.Tensor, steps: int, spacing: str = "leading", offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``steps`` timesteps and ``steps + 1`` sigmas (``sqrt((1 - abar) / abar)``, noisiest first, then 0) of a
    DDPM-trained model, in float32, as ``EulerDiscreteScheduler.set_timesteps`` makes them (linear interpolation,
    ``timestep_spacing`` ``spacing``, ``steps_offset`` ``offset``). A zero terminal SNR's last ``alpha_bar`` is taken as
    2^-24, as diffusers does, so the first sigma is finite."""
    n = len(alphas_cumprod)
    if steps < 1 or spacing not in SPACINGS:
        raise ValueError(f"steps must be at least 1 (got {steps}) and timestep_spacing one of {SPACINGS} ({spacing!r})")
    if spacing == "leading":
        t = (torch.arange(steps, dtype=torch.float64) * (n // steps)).flip(0) + offset
    elif spacing == "trailing":
        t = torch.round(n - torch.arange(steps, dtype=torch.float64) * (n / steps)) - 1
    else:
        t = torch.linspace(0, n - 1, steps, dtype=torch.float64).flip(0)
    abar = alphas_cumprod.float().clone()
    if abar[-1] == 0:
        abar[-1] = 2**-24
    table = (((1 - abar) / abar) ** 0.5).double()
    low = t.floor().long().clamp(0, n - 1)
    sigmas = table[low] + (t - low) * (table[(low + 1).clamp(max=n - 1)] - table[low])  # numpy's interp
    return t.float(), torch.cat([sigmas.float(), torch.zeros(1)])


def ddpm_init_sigma(sigmas: torch.Tensor, spacing: str = "leading") -> torch.Tensor:
    """What the starting noise is scaled by: the largest sigma (``linspace``, ``trailing``), or ``sqrt(max^2 + 1)``."""
    top = sigmas.max()
    return top if spacing in ("linspace", "trailing") else (top**2 + 1) ** 0.5


def ddpm_model_input(latents: torch.Tensor, sigmas: torch.Tensor, index: int) -> torch.Tensor:
    """The model's input at step ``index``: ``latents / sqrt(sigma^2 + 1)`` (the scheduler's ``scale_model_input``)."""
    return latents / ((sigmas[index] ** 2 + 1) ** 0.5)


def ddpm_euler_step(
    latents: torch.Tensor, prediction: torch.Tensor, sigmas: torch.Tensor, index: int, v_prediction: bool = False
) -> torch.Tensor:
    """One Euler step from ``sigmas[index]`` to ``sigmas[index + 1]`` of an epsilon- or v-prediction model, in float32
    (``EulerDiscreteScheduler.step`` without churn)."""
    sample, pred = latents.float(), prediction.float().to(latents.device)
    sigma = sigmas[index].to(latents.device)
    if v_prediction:
        original = pred * (-sigma / (sigma**2 + 1) ** 0.5) + (sample / (sigma**2 + 1))
    else:
        original = sample - sigma * pred
    return sample + (sample - original) / sigma * (sigmas[index + 1].to(latents.device) - sigma)
