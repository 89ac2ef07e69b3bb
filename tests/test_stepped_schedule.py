"""``stepped_schedule`` / ``scheduler_step``: a folder's multistep scheduler (UniPC) stepped through the sampling
hooks' schedule tensor takes exactly the steps of its own loop, which an Euler step on the same sigmas does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffpipe_core.sampling.schedules import flow_euler_step, scheduler_sigmas, scheduler_step, stepped_schedule

UNIPC = {"_class_name": "UniPCMultistepScheduler", "use_flow_sigmas": True, "prediction_type": "flow_prediction"}


def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    return torch.sin(3 * x) * (1 + sigma)  # any model whose output depends on its input and time


def test_the_schedule_steps_as_the_schedulers_own_loop(tmp_path: Path) -> None:
    from diffusers import UniPCMultistepScheduler

    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps({**UNIPC, "flow_shift": 3.0}))
    start = torch.randn(1, 4, 3, 5, generator=torch.Generator().manual_seed(0))
    reference = UniPCMultistepScheduler.from_config(UNIPC | {"flow_shift": 3.0})
    reference.set_timesteps(6)
    expected = start.clone()
    for i, t in enumerate(reference.timesteps):
        expected = reference.step(velocity(expected, reference.sigmas[i]), t, expected).prev_sample
    for _ in range(2):  # each call is a fresh scheduler
        schedule, x = stepped_schedule(tmp_path, 6), start.clone()
        assert torch.equal(schedule, scheduler_sigmas(tmp_path, 6))
        for i in range(len(schedule) - 1):
            x = scheduler_step(x, velocity(x, schedule[i]), schedule, i)
        torch.testing.assert_close(x, expected, rtol=0, atol=0)
    euler = start.clone()
    for i in range(len(schedule) - 1):
        euler = flow_euler_step(euler, velocity(euler, schedule[i]), schedule, i)
    assert (euler - expected).abs().max() > 1e-3  # the multistep solver is not Euler on these sigmas
    with pytest.raises(ValueError, match="step 2 out of order"):
        scheduler_step(x, x, stepped_schedule(tmp_path, 6), 2)
    with pytest.raises(ValueError, match="needs the schedule stepped_schedule made"):
        scheduler_step(x, x, scheduler_sigmas(tmp_path, 6), 0)
