"""Issue 42 (optimizers half) end to end, through the real CLI with 2 processes and 2 pipeline stages on the reference
model: torch's Muon (with AdamW for the rest, from the diffpipe-optimizers plugin), its state offloaded, at
``[optimizer] force_constant_lr`` over a config that asks for warmup and a cosine schedule; its resume from the middle
checkpoint;
and two resumes of copies of the run from that checkpoint with ``--reset-optimizer`` (switching to a pytorch-optimizer
class) and ``--reset-optimizer --reset-dataloader`` (switching to automagic).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_train import make_project, run_dirs

from diffpipe_core.engine import checkpoint as ckpt_io
from diffpipe_core.engine.run_dir import read_metrics, train_losses
from diffpipe_core.testing.processes import run_diffpipe

pytestmark = pytest.mark.slow

FORCED = 2e-3
STEP2 = "checkpoints/step-0000002"


def _train(root: Path, config: Path, *args: str) -> str:
    result = run_diffpipe(["train", "--config", str(config), "--num-procs", "2", *args], cwd=root, timeout=600)
    assert result.returncode == 0, result.output[-4000:]
    return result.output


def _params(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = {}
    for file in (run_dir / "checkpoints" / f"step-{step:07d}").glob("params-stage*.safetensors"):
        params.update(load_file(str(file)))
    return params


def _resumed_copy(root: Path, run_dir: Path, name: str, config_text: str, *flags: str) -> tuple[Path, str]:
    """A copy of the run folder (as it was after the first run) resumed from its step-2 checkpoint."""
    copy = root / name / run_dir.name
    shutil.copytree(root / "first-run", copy)
    config = root / f"{name}.toml"
    config.write_text(config_text)
    return copy, _train(root, config, "--resume", str(copy / STEP2), *flags)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("optimizer_methods")
    config = make_project(root, stages=2, max_steps=4, ckpt=2)
    # one micro-batch per step: 4 steps an epoch, so the step-2 checkpoint is in the middle of epoch 0
    text = config.read_text().replace("gradient_accumulation_steps = 2", "gradient_accumulation_steps = 1")
    muon = f'[optimizer]\ntype = "muon"\nlr = 3e-3\nforce_constant_lr = {FORCED}\noffload = true'
    config.write_text(text.replace("[optimizer]\nlr = 3e-3", muon))
    logs = {"first": _train(root, config)}
    [run_dir] = run_dirs(root)
    first = {"losses": train_losses(run_dir), "metrics": read_metrics(run_dir), "params4": _params(run_dir, 4)}
    shutil.copytree(run_dir, root / "first-run")
    logs["resumed"] = _train(root, config, "--resume", str(run_dir / STEP2))
    came = text.replace("[optimizer]\nlr = 3e-3", '[optimizer]\ntype = "pytorch_optimizer.CAME"\nlr = 3e-3')
    reset, logs["reset"] = _resumed_copy(root, run_dir, "reset", came, "--reset-optimizer")
    automagic = text.replace("[optimizer]\nlr = 3e-3", '[optimizer]\ntype = "automagic"\nlr = 1e-4')
    both, logs["both"] = _resumed_copy(root, run_dir, "both", automagic, "--reset-optimizer", "--reset-dataloader")
    return {"root": root, "run": run_dir, "first": first, "reset": reset, "both": both, "logs": logs}


def test_offloaded_muon_at_a_forced_constant_lr_trains_on_two_stages_and_resumes_exactly(runs: dict[str, Any]) -> None:
    run_dir, first = runs["run"], runs["first"]
    assert sorted(first["losses"]) == [1, 2, 3, 4]
    # warmup_steps = 2 and lr_scheduler = "cosine" are set aside: every step at force_constant_lr
    assert [r["lr"] for r in first["metrics"] if "loss" in r] == [FORCED] * 4
    assert train_losses(run_dir) == first["losses"]
    resumed = _params(run_dir, 4)
    assert resumed.keys() == first["params4"].keys() and len(resumed) > 4
    assert all(torch.equal(resumed[k], first["params4"][k]) for k in resumed)
    for stage in (0, 1):  # each stage's Muon (2-D LoRA matrices) and AdamW halves, in the checkpoint
        state = ckpt_io.read_optimizer_state(run_dir / "checkpoints" / "step-0000004", stage)
        groups = state["optimizer"]["param_groups"]
        assert [g["muon"] for g in groups] == [True], stage  # LoRA tensors are all 2-D
        assert all(set(s) == {"momentum_buffer"} for s in state["optimizer"]["state"].values())
        assert [g["lr"] for g in groups] == [FORCED]


def test_reset_optimizer_keeps_the_weights_and_starts_a_fresh_optimizer(runs: dict[str, Any]) -> None:
    first, reset = runs["first"]["losses"], train_losses(runs["reset"])
    assert "optimizer.type: 'muon' -> 'pytorch_optimizer.CAME' from step 2 (a fresh optimizer" in runs["logs"]["reset"]
    assert "optimizer state starts fresh (the LR schedule goes on from step 2)" in runs["logs"]["reset"]
    assert [reset[s] for s in (1, 2, 3)] == [first[s] for s in (1, 2, 3)]  # step 3's loss is of step 2's weights
    assert reset[4] != first[4]  # CAME's first update, not Muon's
    state = ckpt_io.read_optimizer_state(runs["reset"] / "checkpoints" / "step-0000004", 0)
    [entry, *_] = state["optimizer"]["state"].values()
    assert "exp_avg" in entry and "momentum_buffer" not in entry
    # the schedule goes on from step 2 (config: warmup over 2 steps, then cosine to step 4), not from its warmup
    lrs = {r["step"]: r["lr"] for r in read_metrics(runs["reset"]) if "loss" in r}
    assert (lrs[3], lrs[4]) == (pytest.approx(3e-3), pytest.approx(1.5e-3))


def test_reset_dataloader_starts_the_epoch_over(runs: dict[str, Any]) -> None:
    both = runs["both"]
    log = runs["logs"]["both"]
    assert "epoch 0 starts over from its first micro-batch" in log
    sampler = ckpt_io.read_train_state(both / "checkpoints" / "step-0000004")["sampler"]
    assert (sampler["epoch"], sampler["position"]) == (0, 2)  # two steps into epoch 0 again, not at its end
    uninterrupted = ckpt_io.read_train_state(runs["run"] / "checkpoints" / "step-0000004")["sampler"]
    assert (uninterrupted["epoch"], uninterrupted["position"]) == (0, 4)
    state = ckpt_io.read_optimizer_state(both / "checkpoints" / "step-0000004", 1)
    assert all({"lr_mask", "lr_mask_scale"} <= set(s) for s in state["optimizer"]["state"].values())


def test_resets_without_resume_are_refused_before_work(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text("")
    result = run_diffpipe(["train", "--config", "run.toml", "--reset-dataloader"], cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    assert "--reset-dataloader: only for a resumed run; add --resume" in result.output
