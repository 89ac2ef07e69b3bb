"""``zero_stage = 1`` (issue 44): DeepSpeed's ZeRO stage 1 under the pipeline engine, through the real CLI (gloo).

One full fine-tune of the tiny reference model on 2 data-parallel ranks without sharding and one with: the same
losses and weights, the same (gathered) optimizer state in the checkpoint, half the optimizer-state bytes on each
rank (the worker's memory report, read from the optimizer's state). The sharded run resumed from its step-3
checkpoint on 1 process (the state re-sharded for one replica) repeats its losses.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from diffpipe_core.engine.checkpoint import read_optimizer_state, read_params
from diffpipe_core.engine.run_dir import read_metrics
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_core.testing.processes import cli_env, run_diffpipe
from diffpipe_core.testing.runs import assert_trains_as, losses, run_toml, train
from diffpipe_reference.model import write_tiny_model

STEPS = 6


def config(zero: int, accumulation: int = 1, adapter: dict | None = None) -> str:
    return run_toml(
        {"type": "reference", "path": "model", "dtype": "float32", "timestep_sample_method": "uniform"},
        {"lr": 1e-3},
        adapter,
        max_steps=STEPS, micro_batch_size_per_gpu=2, gradient_accumulation_steps=accumulation,
        checkpoint_every_n_steps=3, seed=7, zero_stage=zero,
    )


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ({"optimizer": {"type": "adamw8bit_kahan"}}, "optimizer.type = 'adamw8bit_kahan'"),
        ({"optimizer": {"type": "automagic"}}, "optimizer.type = 'automagic'"),
        ({"optimizer": {"offload": True}}, "optimizer.offload = true"),
        ({"optimizer": {"gradient_release": True}}, "optimizer.gradient_release = true"),
        ({"optimizer": {"group_lr": {"*.attn*": 1e-4}}}, "optimizer.group_lr"),
    ],
)
def test_zero_stage_refuses_what_it_cannot_work_with(keys: dict, named: str) -> None:
    from pydantic import ValidationError

    from diffpipe_core.config import RunConfig

    base = {"model": {"type": "reference"}, "zero_stage": 1}
    assert RunConfig.model_validate(base).zero_stage == 1
    with pytest.raises(ValidationError, match="zero_stage = 1 \\(valid: 0 or 1\\) cannot work with " + named):
        RunConfig.model_validate({**base, **keys})
    with pytest.raises(ValidationError, match="zero_stage"):
        RunConfig.model_validate({**base, "zero_stage": 2})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The unsharded and the ZeRO-1 run, each 2 processes (2 data-parallel replicas of 1 stage)."""
    root = tmp_path_factory.mktemp("zero")
    write_tiny_model(root / "model")
    write_image_dataset(root / "images", 8, size=(32, 32))
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[32], enable_ar_bucket=False)
    made = []
    for zero in (0, 1):
        (root / f"zero{zero}.toml").write_text(config(zero))
        made.append(train(root, f"zero{zero}.toml", 2, DIFFPIPE_MEMORY_REPORT=str(root / f"memory{zero}")))
    return made[0], made[1]


def state_bytes(report: Path) -> int:
    """The optimizer-state bytes one rank's memory report holds after its last step."""
    phases = json.loads(report.read_text())["phases"]
    return [p for p in phases if "bytes" in p][-1]["bytes"]["optimizer state"]


@pytest.mark.slow
def test_zero1_trains_as_unsharded_with_half_the_state_per_rank(runs: tuple[Path, Path]) -> None:
    plain, zero = runs
    assert len(losses(zero)) == STEPS
    assert losses(zero) == pytest.approx(losses(plain), rel=1e-5, abs=1e-6)
    # the logged (and clipping) gradient norm is the global one: the replicas' partitions add up to the whole
    norms = [[r["grad_norm"] for r in read_metrics(run) if "loss" in r] for run in (plain, zero)]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)
    ckpt = f"checkpoints/step-{STEPS:07d}"
    want, got = read_params(plain / ckpt), read_params(zero / ckpt)
    assert got.keys() == want.keys()
    for name in want:  # key biases get gradients of rounding noise only (softmax ignores them), which AdamW
        # scales to full-size steps: they differ by ~1e-5 while every other tensor agrees to ~1e-7
        tol = 5e-5 if "to_k.bias" in name else 1e-6
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=tol, msg=name)
    # the checkpoint holds the whole state, as the unsharded run's: per parameter, in its numbering
    saved, reference = read_optimizer_state(zero / ckpt, 0), read_optimizer_state(plain / ckpt, 0)
    assert saved["param_names"] == reference["param_names"]
    assert saved["optimizer"]["state"].keys() == reference["optimizer"]["state"].keys()
    for number, entry in reference["optimizer"]["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(saved["optimizer"]["state"][number][key], value, rtol=1e-4, atol=1e-7)
    root = plain.parent.parent
    for rank in (0, 1):
        whole, shard = (state_bytes(root / f"memory{zero}" / f"rank{rank}.json") for zero in (0, 1))
        assert whole > 0 and shard == pytest.approx(whole / 2, rel=0.02), (rank, whole, shard)


@pytest.mark.slow
def test_zero1_resumes_resharded_on_one_process(runs: tuple[Path, Path]) -> None:
    """A copy of the ZeRO run, from its step-3 checkpoint, resumed on 1 process (accumulation 2: the same global
    batch): the two replicas' shards become one, and steps 4-6 repeat the uninterrupted losses."""
    zero = runs[1]
    root = zero.parent.parent
    run = root / "out" / "resumed"
    shutil.copytree(zero, run)
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS:07d}")
    (run / "checkpoints" / "latest").write_text("step-0000003")
    (root / "one.toml").write_text(config(1, accumulation=2))
    result = run_diffpipe(["train", "--config", "one.toml", "--resume", str(run), "--num-procs", "1"], cwd=root,
                          timeout=300, env=cli_env())
    assert result.returncode == 0, result.output[-4000:]
    assert "optimizer state re-split by parameter" in result.output, result.output[-4000:]
    assert "all_gather_into_tensor" not in result.output  # DeepSpeed's deprecation warning stays quiet
    expected = losses(zero)
    got = losses(run)
    assert len(got) == STEPS
    assert got[3:] == pytest.approx(expected[3:], rel=1e-5, abs=1e-6), (got, expected)


@pytest.mark.slow
def test_zero1_lora_trains_as_unsharded(runs: tuple[Path, Path]) -> None:
    """A LoRA on 2 data-parallel replicas with and without ZeRO-1: the same losses and saved LoRA (the first step's
    check that every adapter tensor got a gradient runs before ZeRO's reduction frees them)."""
    root = runs[0].parent.parent
    made = []
    for zero in (0, 1):
        (root / f"lora{zero}.toml").write_text(config(zero, adapter={"rank": 4, "alpha": 8}))
        made.append(train(root, f"lora{zero}.toml", 2))
    assert_trains_as(made[1], made[0], rel=1e-5, atol=1e-6)
