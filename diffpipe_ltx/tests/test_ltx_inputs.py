"""Issue point 3 (first-frame conditioning) and the shared timestep options: with p = 1 every video's first latent
frame is the clean latent at timestep 0 and weighs 0 in the loss; with p = 0 never; images never; p changes no
other draw. The resolution shift equals LTXPipeline's (scheduler constants from the folder)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core import TrainingContext
from diffpipe_core.schema import validate
from diffpipe_ltx.config import LTXConfig
from diffpipe_ltx.packing import pack, unpack
from diffpipe_ltx.plugin import plugin as ltx

B, C, H, W = 64, 8, 2, 3


def draw(path: Path, p: float, frames: int = 3, seed: int = 0, quantile: float | None = None, **kw):
    cfg = validate(LTXConfig, {"type": "ltx-video", "path": path, "first_frame_conditioning_p": p, **kw}, "test")
    g = torch.Generator().manual_seed(100)
    batch = {
        "latents": torch.randn(B, C, frames, H, W, generator=g),
        "t5_embeds": torch.randn(B, 4, 32, generator=g),
        "t5_mask": torch.ones(B, 4, dtype=torch.bool),
    }
    context = TrainingContext(model_config=cfg, eval_quantile=quantile)
    inputs, targets = ltx.prepare_inputs(batch=batch, context=context, generator=torch.Generator().manual_seed(seed))
    return batch, inputs, targets


def test_p_one_keeps_every_first_frame_clean_and_out_of_the_loss(tiny_ltx: Path) -> None:
    batch, (x_t, t, _, _, grid), (target, weight) = draw(tiny_ltx, 1.0)
    assert grid.tolist() == [3, H, W] and t.shape == (B, 3)
    assert torch.all(t[:, 0] == 0) and torch.all(t[:, 1] > 0) and torch.equal(t[:, 1], t[:, 2])
    x = unpack(x_t, 3, H, W)
    assert torch.equal(x[:, :, 0], batch["latents"][:, :, 0])  # exactly the clean latents
    assert not torch.allclose(x[:, :, 1], batch["latents"][:, :, 1])
    w = unpack(weight, 3, H, W)
    assert w.shape == (B, 1, 3, H, W) and torch.all(w[:, :, 0] == 0) and torch.all(w[:, :, 1:] == 1)
    # what the model predicts on the conditioned frame does not count
    wrong_first = unpack(target, 3, H, W).clone()
    wrong_first[:, :, 0] += 5.0
    context = TrainingContext(model_config=validate(LTXConfig, {"type": "ltx-video", "path": tiny_ltx}, "test"))
    assert ltx.compute_loss(outputs=(pack(wrong_first),), targets=(target, weight), context=context) == 0
    assert ltx.compute_loss(outputs=(target + 1.0,), targets=(target, weight), context=context) == pytest.approx(1.0)


def test_p_zero_never_and_p_changes_no_other_draw(tiny_ltx: Path) -> None:
    _, (x0, t0, *_), (target0, weight0) = draw(tiny_ltx, 0.0)
    _, (x1, t1, *_), (target1, _) = draw(tiny_ltx, 1.0)
    assert torch.all(t0 > 0) and torch.all(t0 == t0[:, :1]) and torch.all(weight0 == 1)
    assert torch.equal(t0[:, 1:], t1[:, 1:]) and torch.equal(target0, target1)
    f0, f1 = unpack(x0, 3, H, W), unpack(x1, 3, H, W)
    assert torch.equal(f0[:, :, 1:], f1[:, :, 1:]) and not torch.equal(f0[:, :, 0], f1[:, :, 0])


def test_images_and_evaluation_are_never_conditioned(tiny_ltx: Path) -> None:
    _, (_, t, *_), (_, weight) = draw(tiny_ltx, 1.0, frames=1)
    assert t.shape == (B, 1) and torch.all(t > 0) and torch.all(weight == 1)
    _, (_, t, *_), (_, weight) = draw(tiny_ltx, 1.0, quantile=0.3, timestep_sample_method="uniform")
    assert torch.allclose(t, torch.full_like(t, 0.3)) and torch.all(weight == 1)


def test_p_half_conditions_about_half(tiny_ltx: Path) -> None:
    counts = [int((draw(tiny_ltx, 0.5, seed=s)[1][1][:, 0] == 0).sum()) for s in range(4)]
    assert 0.35 < sum(counts) / (4 * B) < 0.65, counts
    assert len(set(counts)) > 1  # a fresh draw per micro-batch


def test_resolution_shift_is_ltx_pipelines(tiny_ltx: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(str(tiny_ltx / "scheduler"))
    tokens = 3 * H * W
    mu = calculate_shift(
        tokens,
        sched.config.base_image_seq_len,
        sched.config.max_image_seq_len,
        sched.config.base_shift,
        sched.config.max_shift,
    )
    assert sched.config.base_image_seq_len == 1024  # LTX's own constants, not the defaults
    for q in (0.2, 0.5, 0.9):
        t = draw(tiny_ltx, 0.0, quantile=q, timestep_sample_method="uniform", resolution_shift=True, shift=7.0)[1][1]
        expected = sched.time_shift(mu, 1.0, torch.tensor(q, dtype=torch.float64))
        assert torch.allclose(t[:, 0].double(), expected.expand(B), atol=1e-6)
