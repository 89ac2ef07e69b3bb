"""Each DeepSpeed workaround in diffpipe_core/engine/ds_patches.py, checked in a real 2-process
DeepSpeed pipeline on gloo (the ranks run tests/ds_patch_worker.py). Where DeepSpeed's own behaviour
is the reason for a patch, a test also asserts that behaviour still fails, so an upgrade that fixes it
shows up here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from diffpipe_core.engine.launcher import free_port, local_rank_env
from diffpipe_core.testing import processes
from diffpipe_core.testing.processes import cli_env

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("ds_patch_worker.py")
REPO = Path(__file__).resolve().parents[1]
WORLD = 2
DIM = 4  # tests/ds_patch_worker.py's layer width


def run_ranks(scenarios: str, out: Path, timeout: float = 90, grace: float = 5) -> tuple[list[int | None], list[dict]]:
    """Start WORLD ranks of the worker; return their exit codes (None: killed while blocked) and results.

    When a rank fails the others get ``grace`` seconds to notice before their process groups are killed.
    """
    port = free_port()
    envs = [cli_env([REPO], **local_rank_env(rank, WORLD, port), OMP_NUM_THREADS="1") for rank in range(WORLD)]
    codes = processes.run_ranks([sys.executable, str(WORKER), scenarios, str(out)], envs, out, timeout, grace)
    results = []
    for rank in range(WORLD):
        path = out / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    return codes, results


def log_tail(out: Path) -> str:
    return "\n".join(f"--- rank {r}\n" + (out / f"log{r}.txt").read_text()[-4000:] for r in range(WORLD))


@pytest.fixture(scope="module")
def working_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scenarios expected to succeed, in one 2-process run (each DeepSpeed start costs seconds).
    A scenario that fails ends the run, so the tests of it and of the ones after it fail."""
    out = tmp_path_factory.mktemp("ds_ok")
    run_ranks("idle_group,parts,wrapped,forward,single_replica,lean_step,release_inputs,release_heap", out)
    return out


def scenario(out: Path, name: str) -> list[dict[str, Any]]:
    """Every rank's result of one scenario of ``working_run``, which must have succeeded."""
    results = []
    for rank in range(WORLD):
        path = out / f"rank{rank}.json"
        result = json.loads(path.read_text()).get(name) if path.exists() else None
        assert result is not None and "error" not in result, f"{name} failed on rank {rank}\n{log_tail(out)}"
        results.append(result)
    return results


def test_explicit_partition_places_layers_on_given_stages(working_run: Path) -> None:
    stage0, stage1 = scenario(working_run, "parts")
    assert stage0["parts"] == stage1["parts"] == [0, 1, 4]
    # Each layer's weights are filled with its index, so the tags name the global layers a rank holds.
    assert (stage0["local_start"], stage0["local_stop"], stage0["forward_func_tags"]) == (0, 1, [0])
    assert (stage1["local_start"], stage1["local_stop"], stage1["forward_func_tags"]) == (1, 4, [1, 2, 3])
    assert stage0["param_count"] == 20 and stage1["param_count"] == 60  # only its own layers are registered


def test_outputs_require_grad_lets_a_frozen_stage_feed_trainable_ones(working_run: Path, tmp_path: Path) -> None:
    out = working_run
    stage0, stage1 = scenario(out, "wrapped")
    assert stage0["trainable"] == [] and stage1["trainable"], (stage0, stage1)
    assert stage0["loss"] == pytest.approx(stage1["loss"]) and stage0["loss"] > 0
    frozen = torch.load(out / "frozen_first_stage_rank0.pt", weights_only=True)
    trained = torch.load(out / "frozen_first_stage_rank1.pt", weights_only=True)
    for name, before in frozen["before"].items():
        assert torch.equal(before, frozen["after"][name]), f"frozen {name} changed"
    changed = [n for n, before in trained["before"].items() if not torch.equal(before, trained["after"][n])]
    assert sorted(changed) == sorted(trained["before"]), f"only {changed} of stage 1's weights were updated"

    # Without the wrapper DeepSpeed's backward on the frozen stage fails. If this stops failing, a
    # newer DeepSpeed handles frozen stages itself and OutputsRequireGrad can go.
    codes, unwrapped = run_ranks("unwrapped", tmp_path / "unwrapped")
    assert codes[0] == 3, log_tail(tmp_path / "unwrapped")
    assert "does not require grad" in unwrapped[0]["unwrapped"]["error"]


def test_a_boundary_tensor_no_later_layer_uses_is_named(tmp_path: Path) -> None:
    """Without the check DeepSpeed stops at a message-less ``assert buffer.grad is not None``."""
    codes, results = run_ranks("unused_boundary", tmp_path / "unused")
    assert codes[1] == 3, log_tail(tmp_path / "unused")
    error = results[1]["unused_boundary"]["error"]
    assert error.startswith("StageBoundaryError") and "output 1 of layer 0 (Split)" in error, error


def test_forward_outputs_after_a_training_step(working_run: Path) -> None:
    """Without the patch ``eval_batch(compute_loss=False)`` fails on the loss the training step left behind."""
    stage0, stage1 = scenario(working_run, "forward")
    assert stage0["outputs"] is None
    assert stage1["count"] == 2 and stage1["max_error"] < 1e-6, stage1


def test_one_replica_skips_the_gradient_allreduce_and_trains_the_same_weights(working_run: Path) -> None:
    """Each stage is its own data-parallel group of one: DeepSpeed still all-reduces every gradient at the end of
    the step (if that stops, a newer DeepSpeed skips it itself and patch 8 can go); skipped, the weights after the
    step are bit for bit the same."""
    for rank, result in enumerate(scenario(working_run, "single_replica")):
        assert result["reduced"]["allreduce_calls"] >= 1 and not result["reduced"]["turned_off"], result
        assert result["skipped"]["allreduce_calls"] == 0 and result["skipped"]["turned_off"], result
        assert result["skipped"]["loss"] == result["reduced"]["loss"]
        reduced = torch.load(working_run / f"single_replica_reduced_rank{rank}.pt", weights_only=True)
        skipped = torch.load(working_run / f"single_replica_skipped_rank{rank}.pt", weights_only=True)
        assert reduced.keys() == skipped.keys() and reduced
        for name, weight in reduced.items():
            assert torch.equal(weight, skipped[name]), f"rank {rank}: {name} differs without the all-reduce"


def test_a_group_no_replica_used_keeps_no_gradient_and_is_not_stepped(working_run: Path) -> None:
    """One stage on two replicas (patch 10): DeepSpeed gives a parameter without a gradient a zero one before the
    all-reduce, so AdamW still moves a group no replica used (if that stops, the patch can go); patched, the group
    has no gradient at the optimizer step and stays as it was. (The working run's first scenario: its own engines,
    on a fresh process group.)"""
    for result in scenario(working_run, "idle_group"):
        assert not result["plain"]["applied"] and result["plain"]["b_grad_none"] == [False]
        assert result["plain"]["b_moved"] > 1e-3, result
        assert result["patched"]["applied"] and result["patched"]["b_grad_none"] == [True]
        assert result["patched"]["b_moved"] == 0.0, result


def test_lean_step_walks_the_module_tree_only_on_a_mode_change_and_trains_the_same(working_run: Path) -> None:
    """DeepSpeed walks every submodule twice a step (``train()`` and ``zero_grad``'s ``named_parameters``; if it
    stops, patch 9 can go); patched, ``train`` walks on the first step and after an eval pass only, no gradient is
    left after a step, every module is in training mode when it trains, and the weights (dropout included) are bit
    for bit the same."""
    for rank, result in enumerate(scenario(working_run, "lean_step")):
        plain, lean = result["plain"], result["lean"]
        assert plain["walks"] >= 4 and plain["named_parameters"] >= 3, plain  # 3 steps + the eval pass
        assert lean["walks"] == 3 and lean["named_parameters"] == 0, lean  # first step, eval, the step after it
        assert plain["modes"] == lean["modes"] == [True, True, True]
        assert plain["grads"] == lean["grads"] == [0, 0, 0]
        plain_w = torch.load(working_run / f"lean_step_plain_rank{rank}.pt", weights_only=True)
        lean_w = torch.load(working_run / f"lean_step_lean_rank{rank}.pt", weights_only=True)
        assert plain_w.keys() == lean_w.keys() and plain_w
        for name, weight in plain_w.items():
            assert torch.equal(weight, lean_w[name]), f"rank {rank}: {name} differs with patch 9"


def test_forward_inputs_keep_no_data_after_the_forward_and_train_the_same(working_run: Path) -> None:
    """DeepSpeed runs each forward pass on a clone of the input buffer and keeps the buffer, data included, until
    the backward (if it stops, patch 11 can go); patched, the buffer keeps one element's bytes, the losses and
    every stage's weights are bit for bit the same over two steps."""
    for rank, result in enumerate(scenario(working_run, "release_inputs")):
        plain, patched = result["plain"], result["patched"]
        assert len(plain["kept_bytes"]) == len(patched["kept_bytes"]) == 4  # 2 steps x 2 micro-batches
        assert all(b == DIM * 4 for b in plain["kept_bytes"]), plain  # (1, DIM) float32, data kept
        assert all(b == 4 for b in patched["kept_bytes"]), patched
        assert plain["losses"] == patched["losses"]
        before = torch.load(working_run / f"release_inputs_plain_rank{rank}.pt", weights_only=True)
        after = torch.load(working_run / f"release_inputs_patched_rank{rank}.pt", weights_only=True)
        assert before.keys() == after.keys() and before
        for name, weight in before.items():
            assert torch.equal(weight, after[name]), f"rank {rank}: {name} differs with patch 11"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc; elsewhere a no-op")
def test_freed_heap_goes_back_before_the_next_instruction_and_trains_the_same(working_run: Path) -> None:
    """Stage 0's first forward leaves 16 MiB of freed chunks between chunks it keeps. Unpatched they are still
    resident when the next instruction starts (if glibc ever returns them itself, patch 12 can go); with patch 12
    they are back with the system, and the losses are the same."""
    stage0, _ = scenario(working_run, "release_heap")
    plain, patched = stage0["plain"], stage0["patched"]
    assert plain["after"] == patched["after"] == "SendActivation"
    assert plain["retained"] >= 30 * 2**20, plain  # the 16 MiB kept + the 16 MiB of holes
    assert patched["retained"] <= 20 * 2**20, patched  # the 16 MiB kept only
    assert plain["losses"] == patched["losses"]


OP_START = """
import importlib, time
import deepspeed
from diffpipe_core.engine import ds_patches

ds_patches.guard_op_builds(timeout=2, notice_after=0.5)
try:
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # DeepSpeed's own start builds the op
    print("UNPATCHED: no build")
except ds_patches.OpBuildLockTimeout as e:
    print("UNPATCHED:", e)
start = time.monotonic()
ds_patches.init_distributed("gloo")
print("PATCHED:", importlib.import_module("deepspeed.comm.comm").cdb.shm_comm_op, round(time.monotonic() - start, 1))
"""


def test_start_builds_no_op_and_a_needed_build_names_its_stale_lock(tmp_path: Path) -> None:
    """A killed build's lock in the extensions folder: DeepSpeed's own start waits on it (here the guard gives up
    after 2 s and names it; unguarded it waits forever), ours starts without building anything."""
    ext = tmp_path / "ext"
    lock = ext / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    env = cli_env(
        [REPO], TORCH_EXTENSIONS_DIR=str(ext), DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
    )  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", OP_START], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    unpatched = next(line for line in proc.stdout.splitlines() if line.startswith("UNPATCHED"))
    assert f"deepspeed_shm_comm op build waits for the lock {lock}" in unpatched, unpatched
    assert "no process holds it, so it is stale" in unpatched and "gave up after 2s" in unpatched
    assert f"diffpipe: DeepSpeed's deepspeed_shm_comm op build waits for the lock {lock}" in proc.stderr  # the notice
    patched = next(line for line in proc.stdout.splitlines() if line.startswith("PATCHED"))
    assert patched.split()[1] == "None", patched
    built = sorted(p.relative_to(ext).as_posix() for p in ext.rglob("*"))
    assert built == ["deepspeed_shm_comm", "deepspeed_shm_comm/lock"], built


def test_compiled_layers_survive_the_per_output_backward_of_a_stage() -> None:
    """Patch 7: DeepSpeed's non-last stages run backward per output tensor with retain_graph=True; a compiled
    layer's backward refuses that (once buckets of another shape made it recompile dynamic) until buffer donation
    is off. In-process, the same calls DeepSpeed makes."""
    import inspect

    import torch._dynamo
    import torch._functorch.config
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from diffpipe_core.engine.ds_patches import keep_compiled_backward_buffers

    assert "retain_graph=(i < len(out_tensors) - 1)" in inspect.getsource(PipelineEngine._exec_backward_pass)

    def stage_backward() -> None:
        layer = nn_layer()
        layer.compile(backend="aot_eager")
        for batch in (2, 3):  # a second bucket shape: the dynamic-shape recompile saves donated buffers
            outputs = layer(torch.randn(batch, 4, requires_grad=True))
        for i, out in enumerate(outputs):  # PipelineEngine._exec_backward_pass, for a tuple of outputs
            out.backward(gradient=torch.ones_like(out), retain_graph=i < len(outputs) - 1)

    with torch._functorch.config.patch(donated_buffer=True):
        torch._dynamo.reset()
        with pytest.raises(RuntimeError, match="donated buffers"):
            stage_backward()
        keep_compiled_backward_buffers()
        torch._dynamo.reset()
        stage_backward()
    torch._dynamo.reset()


def nn_layer() -> torch.nn.Module:
    class TwoOutputs(torch.nn.Module):  # like an embedder returning hidden states and conditioning
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.tanh(self.proj(x))
            return h * 2, h.sum(-1)

    return TwoOutputs()
