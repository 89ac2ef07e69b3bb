"""Issue point 3 for the plugins (the core's EDM maths itself: tests/test_edm.py): Cosmos-1.0's inputs and loss are
the EDM formulas at several sigma; Predict2's flow-matching pair and its optional t^2 + (1-t)^2 weighting are
NVIDIA's EDM parameterisation (the Cosmos2 pipeline's c_in / c_skip / c_out, sigma_data 1) rewritten in t."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from diffpipe_core import TrainingContext, edm
from diffpipe_core.schema import validate
from diffpipe_cosmos.config import Cosmos1Config, Predict2Config
from diffpipe_cosmos.plugin import cosmos1, nvidia_weight, predict2


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(3, 4, 2, 4, 6, generator=g), "t5_embeds": torch.randn(3, 16, 16, generator=g)}


@pytest.mark.parametrize("quantile", [0.05, 0.5, 0.95])
def test_cosmos1_inputs_and_loss_are_the_edm_formulas(quantile: float) -> None:
    cfg = validate(Cosmos1Config, {"type": "cosmos", "path": Path("x"), "p_mean": 0.3, "p_std": 1.4}, "test")
    plugin, data = cosmos1, batch()
    context = TrainingContext(cfg, eval_quantile=quantile)
    (model_in, c_noise, text), targets = plugin.prepare_inputs(data, context, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    noise = torch.randn(data["latents"].shape, generator=g)
    sigma = math.exp(0.3 + 1.4 * math.sqrt(2) * torch.erfinv(torch.tensor(2 * quantile - 1)).item())
    s, sd = sigma, 0.5
    x = data["latents"] + s * noise
    assert torch.allclose(model_in, x / math.sqrt(s * s + sd * sd), atol=1e-5)
    assert torch.allclose(c_noise, torch.full((3,), 0.25 * math.log(s)), atol=1e-6)
    assert torch.equal(text, data["t5_embeds"])
    out = torch.randn(model_in.shape, generator=g)
    denoised = sd**2 / (s * s + sd * sd) * x + s * sd / math.sqrt(s * s + sd * sd) * out
    expected = ((s * s + sd * sd) / (s * sd) ** 2 * (denoised - data["latents"]) ** 2).mean()
    loss = plugin.compute_loss((out,), targets)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)


def test_cosmos1_sigmas_are_log_normal_when_training() -> None:
    cfg = validate(Cosmos1Config, {"type": "cosmos", "path": Path("x")}, "test")
    data = {"latents": torch.zeros(4000, 1, 1, 1, 1), "t5_embeds": torch.zeros(4000, 1, 1)}
    _, targets = cosmos1.prepare_inputs(data, TrainingContext(cfg), torch.Generator().manual_seed(0))
    logs = targets[2].log()
    assert logs.mean().item() == pytest.approx(0.0, abs=0.06) and logs.std().item() == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("nvidia_weighting", [False, True])
def test_predict2_is_nvidias_edm_parameterisation_as_rectified_flow(nvidia_weighting: bool) -> None:
    table = {"type": "cosmos-predict2", "path": Path("x"), "nvidia_weighting": nvidia_weighting}
    cfg = validate(Predict2Config, table, "test")
    plugin, data = predict2, batch()
    (x_t, t, _), targets = plugin.prepare_inputs(data, TrainingContext(cfg), torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    noise = torch.randn(data["latents"].shape, generator=g)
    t_b = t.view(-1, 1, 1, 1, 1)
    x0 = data["latents"]
    assert torch.allclose(x_t, (1 - t_b) * x0 + t_b * noise, atol=1e-6)
    assert torch.allclose(targets[0], noise - x0, atol=1e-6)
    assert torch.equal(targets[1], nvidia_weight(t) if nvidia_weighting else torch.ones(3))

    # NVIDIA's view (Cosmos2TextToImagePipeline): sigma = t / (1 - t), x_sigma = x0 + sigma * noise; the model
    # sees c_in * x_sigma with c_in = 1 - t, and D = c_skip * x_sigma + c_out * F with c_skip = 1 - t, c_out = -t.
    sigma = (t / (1 - t)).view(-1, 1, 1, 1, 1)
    x_sigma = x0 + sigma * noise
    assert torch.allclose((1 - t_b) * x_sigma, x_t, atol=1e-5)
    assert torch.allclose((1 - t_b) * x_sigma - t_b * targets[0], x0, atol=1e-5)  # the velocity denoises exactly
    out = torch.randn(x_t.shape, generator=g)
    denoised = (1 - t_b) * x_sigma - t_b * out
    edm_weight = edm.loss_weight(sigma.flatten(), sigma_data=1.0).view(-1, 1, 1, 1, 1)
    nvidia_loss = (edm_weight * (denoised - x0) ** 2).mean()
    loss = plugin.compute_loss((out,), targets)
    plain = ((out - targets[0]) ** 2).mean()
    if nvidia_weighting:
        assert loss.item() == pytest.approx(nvidia_loss.item(), rel=1e-4)
    else:
        assert loss.item() == pytest.approx(plain.item(), rel=1e-6)
        assert abs(loss.item() - nvidia_loss.item()) > 1e-3


def test_nvidia_weight_formula() -> None:
    t = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0])
    assert torch.allclose(nvidia_weight(t), torch.tensor([1.0, 0.82, 0.5, 0.82, 1.0]))


def test_masks_weight_the_loss() -> None:
    cfg = validate(Predict2Config, {"type": "cosmos-predict2", "path": Path("x")}, "test")
    data = batch()
    data["mask"] = torch.zeros(3, 1, 1, 4, 6)
    data["mask"][..., :3] = 1
    (x_t, _, _), targets = predict2.prepare_inputs(data, TrainingContext(cfg), torch.Generator())
    out = targets[0].clone()
    out[..., 3:] += 100.0  # errors only where the mask is 0
    assert predict2.compute_loss((out,), targets).item() == pytest.approx(0.0, abs=1e-10)
    assert x_t.shape == data["latents"].shape


@pytest.mark.parametrize("quantile", [0.1, 0.5, 0.9])
def test_nvidia_log_normal_sigma_is_a_shifted_logit_normal_t(quantile: float) -> None:
    """README claim: log sigma ~ N(mu, s) in sigma = t / (1 - t) is sigmoid_scale = s, shift = e^mu."""
    from diffpipe_core.diffusion import sample_timesteps

    mu, s = -0.6, 1.3
    sigma = edm.sample_sigmas(1, torch.Generator(), p_mean=mu, p_std=s, quantile=quantile)
    t = sample_timesteps(1, torch.Generator(), "logit_normal", s, math.exp(mu), quantile=quantile)
    assert torch.allclose(t, sigma / (1 + sigma), atol=1e-6)
