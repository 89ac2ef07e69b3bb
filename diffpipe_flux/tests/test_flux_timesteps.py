"""Issue point 4: timestep sampling and Flux's resolution shift match their formulas (fixed seeds,
Kolmogorov-Smirnov distances against the exact CDFs), and the flow-matching inputs are what they claim."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from diffpipe_core import TrainingContext
from diffpipe_core.schema import validate
from diffpipe_flux.config import FluxConfig
from diffpipe_flux.packing import pack
from diffpipe_flux.plugin import plugin as flux

N = 20000
KS_1PCT = 1.63 / math.sqrt(N)  # Kolmogorov-Smirnov critical distance at the 1% level


def cfg(**kw) -> FluxConfig:
    return validate(FluxConfig, {"type": "flux", "path": Path("."), **kw}, "test")


def draw(
    config: FluxConfig, latent_hw: tuple[int, int] = (8, 8), seed: int = 0, quantile: float | None = None, n: int = N
):
    batch = {
        "latents": torch.randn(n, 1, *latent_hw, generator=torch.Generator().manual_seed(seed + 1)),
        "t5_embeds": torch.zeros(n, 1, 1),
        "clip_pooled": torch.zeros(n, 1),
    }
    context = TrainingContext(model_config=config, eval_quantile=quantile)
    inputs, targets = flux.prepare_inputs(batch, context, torch.Generator().manual_seed(seed))
    return batch, inputs, targets


def ks(samples: torch.Tensor, cdf) -> float:
    x = samples.double().sort().values
    n = len(x)
    f = cdf(x)
    upper = torch.arange(1, n + 1, dtype=torch.float64) / n - f
    lower = f - torch.arange(0, n, dtype=torch.float64) / n
    return float(torch.maximum(upper, lower).max())


def shifted_uniform_cdf(s: float):
    # t' = s t / (1 + (s - 1) t)  <=>  t = t' / (s - (s - 1) t'); t ~ U(0, 1)
    return lambda y: y / (s - (s - 1) * y)


def normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


def test_uniform() -> None:
    t = draw(cfg(timestep_sample_method="uniform"))[1][1]
    assert ks(t, lambda y: y) < KS_1PCT


@pytest.mark.parametrize("scale", [1.0, 1.5])
def test_logit_normal(scale: float) -> None:
    t = draw(cfg(timestep_sample_method="logit_normal", sigmoid_scale=scale))[1][1]
    logits = torch.log(t.double() / (1 - t.double())) / scale
    assert ks(logits, normal_cdf) < KS_1PCT
    assert ks(logits * scale / 1.2, normal_cdf) > KS_1PCT  # a wrong scale is detected


def test_fixed_shift() -> None:
    t = draw(cfg(timestep_sample_method="uniform", shift=3.0))[1][1]
    assert ks(t, shifted_uniform_cdf(3.0)) < KS_1PCT
    assert ks(t, lambda y: y) > 10 * KS_1PCT


@pytest.mark.parametrize("latent_hw", [(8, 8), (32, 32), (64, 48)])
def test_flux_resolution_shift(latent_hw: tuple[int, int]) -> None:
    n = 8000
    tokens = (latent_hw[0] // 2) * (latent_hw[1] // 2)
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (tokens - 256)  # FluxPipeline's calculate_shift defaults
    t = draw(cfg(timestep_sample_method="uniform", flux_shift=True, shift=7.0), latent_hw=latent_hw, n=n)[1][1]
    assert ks(t, shifted_uniform_cdf(math.exp(mu))) < 1.63 / math.sqrt(n)  # shift=7 is ignored under flux_shift
    assert ks(t, shifted_uniform_cdf(math.exp(mu) * 1.15)) > 1.63 / math.sqrt(n)


def test_flux_shift_matches_the_diffusers_scheduler() -> None:
    """For a given t, our shift gives the sigma FlowMatchEulerDiscreteScheduler uses with dynamic shifting."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffpipe_core.diffusion import flux_resolution_shift, shift_timesteps

    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    tokens = 1024
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (tokens - 256)
    sigmas = torch.linspace(1.0, 0.05, 8)
    expected = sched.time_shift(mu, 1.0, sigmas)
    assert torch.allclose(shift_timesteps(sigmas, flux_resolution_shift(tokens)), expected.float(), atol=1e-6)


def test_eval_quantile_and_flow_matching_pair() -> None:
    config = cfg(timestep_sample_method="logit_normal", guidance=3.5)
    t = draw(config, quantile=0.5)[1][1]
    assert torch.allclose(t, torch.full_like(t, 0.5))
    batch, inputs, targets = draw(config, latent_hw=(4, 6))
    x_t, t, _, _, guidance, img_ids, txt_ids = inputs
    # x_t = (1 - t) x + t noise and target = noise - x  =>  x_t = x + t * target
    assert torch.allclose(x_t, pack(batch["latents"]) + t[:, None, None] * targets[0], atol=1e-5)
    assert x_t.shape == (N, 6, 4) and img_ids.shape == (6, 3) and txt_ids.shape == (1, 3)
    assert torch.all(guidance == 3.5)
    again = draw(config, latent_hw=(4, 6))[1]
    assert torch.equal(again[0], x_t)  # same generator seed, same draws
