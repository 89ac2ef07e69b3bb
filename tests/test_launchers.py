"""Launching beyond our own launcher (issue 10): as workers of an external launcher, and DeepSpeed's hostfile
launcher. Both train 2 pipeline stages on loopback and must save one adapter."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train import make_project, run_dirs, train

from diffpipe_core.engine.launcher import free_port, hostfile_slots
from diffpipe_core.engine.run_dir import read_metrics
from diffpipe_core.testing.processes import cli_env, kill_group

pytestmark = pytest.mark.slow


def test_two_nodes_started_by_a_scheduler_train_two_stages(tmp_path: Path) -> None:
    """What a SLURM script does: one `diffpipe train` per node, with node ranks 0 and 1 and one worker each."""
    config = make_project(tmp_path, stages=2, max_steps=4, ckpt=100)
    port = str(free_port())
    procs, logs = [], []
    try:
        for rank in (0, 1):
            log = (tmp_path / f"node{rank}.log").open("w")
            logs.append(tmp_path / f"node{rank}.log")
            env = cli_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "diffpipe_core.cli", "train", "--config", str(config)],
                    cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            )
            log.close()
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            kill_group(p)
            p.wait()
    output = "\n".join(f"--- node {r}\n" + log.read_text()[-3000:] for r, log in enumerate(logs))
    assert codes == [0, 0], output
    runs = run_dirs(tmp_path)
    assert len(runs) == 1, f"the nodes made {len(runs)} run folders\n{output}"
    assert [r["step"] for r in read_metrics(runs[0]) if "loss" in r] == [1, 2, 3, 4]
    assert (runs[0] / "saved" / "final" / "adapter_model.safetensors").is_file()
    assert "diffpipe: run folder" in logs[0].read_text()


def test_a_hostfile_hands_the_launch_to_deepspeed(tmp_path: Path) -> None:
    config = make_project(tmp_path, stages=2, max_steps=2, ckpt=100)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# one machine, two workers\nlocalhost slots=2\n")
    assert hostfile_slots(hostfile) == 2
    train(tmp_path, config, "--hostfile", str(hostfile), timeout=400)  # no --num-procs: the hostfile's 2 slots
    run = run_dirs(tmp_path)[0]
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2]
    assert (run / "saved" / "final" / "adapter_model.safetensors").is_file()


def test_a_malformed_hostfile_is_named(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2 gpus=4\n")
    with pytest.raises(ValueError, match=r"hosts:2: expected 'hostname slots=N', got 'node2 gpus=4'"):
        hostfile_slots(hostfile)


def test_workers_started_fresh_train_what_forked_workers_train(reference_two_stages: Path, tmp_path: Path) -> None:
    """CPU workers are forked from a launcher that imported the libraries once; GPU workers start as fresh
    processes (``DIFFPIPE_WORKER_START=spawn`` on CPU): both train the same 2-stage run, step for step (the forked
    reference run's first steps, at its constant learning rate)."""
    config = make_project(tmp_path, stages=2, max_steps=3, ckpt=100)
    train(tmp_path, config, "--num-procs", "2", env=cli_env(DIFFPIPE_WORKER_START="spawn"))
    fresh = [r["loss"] for r in read_metrics(run_dirs(tmp_path)[0]) if "loss" in r]
    forked = [r["loss"] for r in read_metrics(reference_two_stages) if "loss" in r][:3]
    assert fresh == pytest.approx(forked, rel=1e-6, abs=1e-7) and len(fresh) == 3
