"""diffpipe_core.edm: EDM preconditioning, loss weight and sigma sampling against their formulas and against
diffusers' EDMEulerScheduler (the scheduler Cosmos-1.0 samples with)."""

from __future__ import annotations

import math

import pytest
import torch

from diffpipe_core import edm

SIGMAS = [0.002, 0.05, 0.5, 1.0, 3.7, 80.0]


@pytest.mark.parametrize("sigma_data", [0.5, 1.0])
def test_preconditioning_matches_formulas(sigma_data: float) -> None:
    sigma = torch.tensor(SIGMAS)
    pre = edm.preconditioning(sigma, sigma_data)
    for i, s in enumerate(SIGMAS):
        total = s * s + sigma_data * sigma_data
        assert pre.c_skip[i].item() == pytest.approx(sigma_data**2 / total, rel=1e-6)
        assert pre.c_out[i].item() == pytest.approx(s * sigma_data / math.sqrt(total), rel=1e-6)
        assert pre.c_in[i].item() == pytest.approx(1 / math.sqrt(total), rel=1e-6)
        assert pre.c_noise[i].item() == pytest.approx(0.25 * math.log(s), rel=1e-6, abs=1e-7)
        weight = edm.loss_weight(sigma, sigma_data)[i].item()
        assert weight == pytest.approx(total / (s * sigma_data) ** 2, rel=1e-6)
        assert weight * pre.c_out[i].item() ** 2 == pytest.approx(1.0, rel=1e-5)


def test_preconditioning_matches_diffusers_edm_scheduler() -> None:
    from diffusers import EDMEulerScheduler

    sched = EDMEulerScheduler(sigma_data=0.5, prediction_type="epsilon")
    x, out = torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    for s in SIGMAS:
        sigma = torch.tensor([s])
        pre = edm.preconditioning(sigma, 0.5)
        assert torch.allclose(sched.precondition_inputs(x, sigma), pre.c_in * x, rtol=1e-5)
        assert torch.allclose(sched.precondition_noise(sigma), pre.c_noise, rtol=1e-5, atol=1e-7)
        assert torch.allclose(sched.precondition_outputs(x, out, sigma), edm.denoise(out, x, sigma, 0.5), atol=1e-5)


def test_loss_is_weighted_error_of_the_denoiser() -> None:
    g = torch.Generator().manual_seed(0)
    latents, noise, out = (torch.randn(3, 2, 4, 4, generator=g) for _ in range(3))
    sigma = torch.tensor([0.1, 1.0, 20.0])
    x = edm.noisy(latents, noise, sigma)
    assert torch.allclose(x[2], latents[2] + 20.0 * noise[2])
    loss = edm.edm_loss(out, x, latents, sigma, 0.5)
    per_sample = [
        edm.loss_weight(sigma[i : i + 1], 0.5)
        * ((edm.denoise(out[i : i + 1], x[i : i + 1], sigma[i : i + 1]) - latents[i]) ** 2).mean()
        for i in range(3)
    ]
    assert torch.allclose(loss, torch.stack(per_sample).mean(), rtol=1e-5)
    # a perfect denoiser has zero loss; a mask keeps only its region
    c = edm.preconditioning(sigma, 0.5)
    perfect = (latents - c.c_skip.view(-1, 1, 1, 1) * x) / c.c_out.view(-1, 1, 1, 1)
    assert edm.edm_loss(perfect, x, latents, sigma, 0.5).item() < 1e-8
    mask = torch.zeros(3, 1, 4, 4)
    mask[..., :2] = 1
    masked = edm.edm_loss(out, x, latents, sigma, 0.5, mask)
    cut = out.clone()
    cut[..., 2:] = perfect[..., 2:]
    assert torch.allclose(masked, 2 * edm.edm_loss(cut, x, latents, sigma, 0.5), rtol=1e-5)


def test_sigma_sampling_is_log_normal_and_seeded() -> None:
    a = edm.sample_sigmas(20000, torch.Generator().manual_seed(1), p_mean=-0.4, p_std=1.3)
    b = edm.sample_sigmas(20000, torch.Generator().manual_seed(1), p_mean=-0.4, p_std=1.3)
    assert torch.equal(a, b) and (a > 0).all()
    logs = a.log()
    assert logs.mean().item() == pytest.approx(-0.4, abs=0.04)
    assert logs.std().item() == pytest.approx(1.3, abs=0.04)
    median = edm.sample_sigmas(4, torch.Generator(), p_mean=-0.4, p_std=1.3, quantile=0.5)
    assert torch.allclose(median, torch.full((4,), math.exp(-0.4)))
    q = edm.sample_sigmas(1, torch.Generator(), p_mean=0.0, p_std=1.0, quantile=0.8413447)
    assert q.item() == pytest.approx(math.e, rel=1e-4)


@pytest.mark.parametrize("final", ["sigma_min", "zero"])
def test_karras_sigmas_and_euler_step_are_edm_euler_schedulers(final: str) -> None:
    """diffpipe_core.sampling.schedules: the Karras levels and the EDM Euler step (from the denoised latents) are
    EDMEulerScheduler's with the same settings, step for step."""
    from diffusers import EDMEulerScheduler

    from diffpipe_core.sampling.schedules import edm_euler_step, karras_sigmas

    sched = EDMEulerScheduler(sigma_min=0.002, sigma_max=80.0, sigma_data=0.5, final_sigmas_type=final)
    sched.set_timesteps(6)
    sigmas = karras_sigmas(6, 0.002, 80.0, 7.0, final_zero=final == "zero")
    assert torch.equal(sigmas, sched.sigmas)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 2, 3, 3, generator=g) * 80.0
    ours = x.clone()
    for i, t in enumerate(sched.timesteps):
        out = torch.randn(x.shape, generator=g)
        denoised = edm.denoise(out, ours, sigmas[i], 0.5)
        sched.scale_model_input(x, t)
        x = sched.step(out, t, x, return_dict=False)[0]
        ours = edm_euler_step(ours, denoised, sigmas, i)
        torch.testing.assert_close(ours, x, rtol=1e-5, atol=1e-5)
