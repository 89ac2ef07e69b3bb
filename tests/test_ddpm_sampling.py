"""The DDPM-family sampler the UNet plugins share (issue 21): timesteps, sigmas, the starting noise scale, the model
input scale and the Euler step equal diffusers' ``EulerDiscreteScheduler`` for every timestep spacing, epsilon and
v-prediction, with and without zero terminal SNR."""

from __future__ import annotations

import pytest
import torch
from diffusers import EulerDiscreteScheduler

from diffpipe_core.ddpm import alphas_cumprod
from diffpipe_core.sampling.schedules import ddpm_euler_step, ddpm_init_sigma, ddpm_model_input, ddpm_sigmas


@pytest.mark.parametrize(
    ("spacing", "offset", "ztsnr", "prediction"),
    [
        ("leading", 1, False, "epsilon"),
        ("leading", 1, False, "v_prediction"),
        ("trailing", 0, True, "v_prediction"),
        ("linspace", 0, False, "epsilon"),
    ],
)
def test_ddpm_euler_equals_euler_discrete_scheduler(spacing: str, offset: int, ztsnr: bool, prediction: str) -> None:
    steps = 7
    sched = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        timestep_spacing=spacing,
        steps_offset=offset,
        rescale_betas_zero_snr=ztsnr,
        prediction_type=prediction,
    )
    sched.set_timesteps(steps)
    abar = alphas_cumprod(zero_terminal_snr=ztsnr, dtype=torch.float32)
    timesteps, sigmas = ddpm_sigmas(abar, steps, spacing, offset)
    torch.testing.assert_close(timesteps, sched.timesteps, rtol=0, atol=0)
    torch.testing.assert_close(sigmas, sched.sigmas, rtol=1e-6, atol=0)
    init = torch.as_tensor(sched.init_noise_sigma)
    torch.testing.assert_close(ddpm_init_sigma(sigmas, spacing), init, rtol=1e-6, atol=0)

    g = torch.Generator().manual_seed(0)
    ours = theirs = torch.randn(1, 4, 8, 8, generator=g) * sched.init_noise_sigma
    for index, t in enumerate(sched.timesteps):
        scaled = sched.scale_model_input(theirs, t)
        torch.testing.assert_close(ddpm_model_input(ours, sigmas, index), scaled, rtol=1e-5, atol=1e-6)
        pred = torch.randn(1, 4, 8, 8, generator=g)
        theirs = sched.step(pred, t, theirs).prev_sample
        ours = ddpm_euler_step(ours, pred, sigmas, index, prediction == "v_prediction")
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_ddpm_sigmas_refuse_bad_arguments() -> None:
    with pytest.raises(ValueError, match="timestep_spacing one of"):
        ddpm_sigmas(alphas_cumprod(), 4, "karras")
    with pytest.raises(ValueError, match="steps must be at least 1"):
        ddpm_sigmas(alphas_cumprod(), 0)
