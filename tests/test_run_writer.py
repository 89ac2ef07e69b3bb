"""Issue 37.1, 37.4 and 37.5: a run folder has one writer (a second ``train --resume`` of a live run is refused,
naming it; a killed run's lock is stale), a resume on a dataset grown in place says the data order restarts, and
SIGINT to the launcher alone is said as SIGINT. Real runs of the reference
plugin, each in its own process group with a timeout; every wait is for an event (a checkpoint written)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from diffpipe_core.engine.checkpoint_check import checkpoint_problems, step_of
from diffpipe_core.engine.run_dir import LATEST
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_core.testing.processes import kill_group, run_diffpipe, start_diffpipe
from diffpipe_reference.model import write_tiny_model

pytestmark = pytest.mark.slow

RUN = """
output_dir = "out"
dataset = "dataset.toml"
max_steps = {max_steps}
micro_batch_size_per_gpu = 2
checkpoint_every_n_steps = 1
[model]
type = "reference"
path = "model"
[adapter]
rank = 4
[optimizer]
lr = 1e-3
"""


def project(root: Path, max_steps: int) -> Path:
    if not (root / "model").exists():
        write_tiny_model(root / "model")
        write_image_dataset(root / "images", 4, size=(64, 64))
        write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[64])
    (root / "run.toml").write_text(RUN.format(max_steps=max_steps))
    return root / "run.toml"


def wait_for_checkpoint(root: Path, proc, timeout: float = 300) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        marker = next(root.glob(f"out/*/checkpoints/{LATEST}"), None)
        if marker is not None:
            return marker.parent.parent
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    pytest.fail("no checkpoint was written in time")


def test_a_second_writer_is_refused_and_a_killed_ones_lock_is_stale(tmp_path: Path) -> None:
    config = project(tmp_path, max_steps=100000)
    first = start_diffpipe(["train", "--config", str(config)], cwd=tmp_path)
    try:
        run = wait_for_checkpoint(tmp_path, first)
        second = run_diffpipe(["train", "--config", str(config), "--resume", "latest"], cwd=tmp_path, timeout=300)
        assert first.poll() is None
    finally:
        kill_group(first)  # SIGKILL: the lock is left behind
        first.communicate()
    assert second.returncode == 1, second.output[-3000:]
    said = [line for line in second.stderr.splitlines() if "being written" in line]
    assert len(said) == 1 and said[0].startswith(f"diffpipe: error: {run} is being written by another diffpipe run "
                                                 f"(pid {first.pid} "), second.stderr
    assert "Traceback" not in second.output
    assert (run / ".writer.lock").is_file()
    # what --resume latest picks: the newest whole checkpoint, which the kill may have left before `latest` named it
    whole = [p for p in (run / "checkpoints").glob("step-*") if step_of(p) is not None and not checkpoint_problems(p)]
    steps = max(step_of(p) for p in whole)
    project(tmp_path, max_steps=steps + 1)
    third = run_diffpipe(["train", "--config", str(config), "--resume", "latest"], cwd=tmp_path, timeout=300)
    assert third.returncode == 0, third.output[-3000:]
    assert f"resuming run {run} from step {steps}" in third.stdout


def test_sigint_to_the_launcher_alone_is_said_as_sigint(tmp_path: Path) -> None:
    config = project(tmp_path, max_steps=100000)
    proc = start_diffpipe(["train", "--config", str(config)], cwd=tmp_path)
    try:
        wait_for_checkpoint(tmp_path, proc)
        proc.send_signal(signal.SIGINT)  # to the launcher only (kill -INT), not the process group a tty signals
        out, err = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode == 130, (out + err)[-3000:]
    stops = [line for line in (out + err).splitlines() if "stopped by" in line]
    assert len(stops) == 1 and stops[0].startswith("diffpipe: stopped by SIGINT after step "), out + err


def test_a_dataset_grown_in_place_then_resumed_says_the_data_order_restarts(tmp_path: Path) -> None:
    """Issue 37.4: 4 images, 2 steps of micro-batches of 2 (a checkpoint each step); a fifth image added in place
    (still 2 micro-batches an epoch, so nothing else notices); the resume encodes it and says the order restarts."""
    config = project(tmp_path, max_steps=3)
    first = run_diffpipe(["train", "--config", str(config)], cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.output[-3000:]
    write_image_dataset(tmp_path / "more", 5, size=(64, 64))
    for suffix in (".png", ".txt"):
        (tmp_path / "more" / f"img_004{suffix}").rename(tmp_path / "images" / f"img_004{suffix}")
    project(tmp_path, max_steps=5)
    resumed = run_diffpipe(["train", "--config", str(config), "--resume", "latest"], cwd=tmp_path, timeout=300)
    assert resumed.returncode == 0, resumed.output[-3000:]
    said = [line for line in resumed.output.splitlines() if "the dataset changed" in line]
    assert said == ["diffpipe: the dataset changed since step-0000003 (4 samples then, 5 now): the epoch starts "
                    "over in the new data's order"], resumed.output[-3000:]
