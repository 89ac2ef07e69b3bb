"""Issue 20.1 and 20.11 without DeepSpeed: how a worker takes SIGTERM/Ctrl-C (diffpipe_core.engine.stopping,
in-process) and how the launcher stops, names the rank that failed first, and puts its error on its own line
(diffpipe_core.engine.launcher, with small real worker processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from diffpipe_core.engine import stopping
from diffpipe_core.testing.processes import kill_group, wait_for_file


@pytest.fixture()
def handlers():
    saved = {s: signal.getsignal(s) for s in stopping.STOP_SIGNALS}
    stopping._requested = 0
    stopping.install()
    yield
    stopping._requested = 0
    for s, h in saved.items():
        signal.signal(s, h)


def _deliver(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the handler runs at the next bytecode


def test_a_signal_before_training_stops_at_once(handlers) -> None:
    with pytest.raises(stopping.Stopped) as info:
        _deliver(signal.SIGTERM)
    assert info.value.code == 143 and not info.value.agreed


def test_while_training_the_first_signal_waits_for_the_step_and_a_second_ctrl_c_ends_at_once(handlers) -> None:
    with stopping.graceful():
        assert stopping.requested(torch.device("cpu")) == 0
        _deliver(signal.SIGINT)  # no exception: the step goes on
        assert stopping.requested(torch.device("cpu")) == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # the next Ctrl-C: the default action, at once
        signal.signal(signal.SIGINT, stopping._handler)
        _deliver(signal.SIGTERM)  # a scheduler's SIGTERM after it changes nothing: the first signal counts
        assert stopping.requested(torch.device("cpu")) == signal.SIGINT


FAKE_WORKER = """
import os, signal, sys, time
from pathlib import Path
rank, mode = int(os.environ["RANK"]), sys.argv[1]
if mode == "stop":  # like a training worker: a signal is noted, the step finishes, then it leaves with 128 + sig
    got = []
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    signal.signal(signal.SIGINT, lambda s, f: got.append(s))
    Path(os.environ["OUT"], f"ready{rank}").touch()
    while not got:
        time.sleep(0.05)
    time.sleep(1.0)  # finishing the step and checkpointing
    sys.exit(128 + got[0])
if mode == "hang":  # a step that never ends: it notes a signal and goes on; only SIGKILL (a second Ctrl-C) stops it
    signal.signal(signal.SIGTERM, lambda s, f: Path(os.environ["OUT"], f"signalled{rank}").touch())
    signal.signal(signal.SIGINT, lambda s, f: Path(os.environ["OUT"], f"signalled{rank}").touch())
    Path(os.environ["OUT"], f"ready{rank}").touch()
    while True:
        time.sleep(3600)
if mode == "killed":  # rank 1 dies while caching; rank 0 waits in a collective until the launcher stops it
    sys.stderr.write("train:  40%|####      | 4/10 [00:02<00:03]")  # a progress bar mid-line
    sys.stderr.flush()
    if rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
"""


def _launch(tmp_path: Path, mode: str, procs: int = 2) -> subprocess.Popen:
    (tmp_path / "fake_worker.py").write_text(FAKE_WORKER)
    code = textwrap.dedent(f"""
        import sys
        from diffpipe_core.engine.launcher import launch_workers
        sys.exit(launch_workers([{mode!r}], {procs}, worker=(sys.executable, {str(tmp_path / "fake_worker.py")!r}),
                                 backend="gloo"))
    """)
    env = {**os.environ, "OUT": str(tmp_path)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _wait_ready(tmp_path: Path, procs: int, proc: subprocess.Popen) -> None:
    for r in range(procs):
        wait_for_file(tmp_path / f"ready{r}", proc, what=f"worker rank {r} starting")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_launcher_passes_a_stop_on_and_exits_with_the_conventional_code(tmp_path: Path, signum: int) -> None:
    proc = _launch(tmp_path, "stop")
    try:
        _wait_ready(tmp_path, 2, proc)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    assert proc.returncode == 128 + signum, err  # 143 for SIGTERM, 130 for Ctrl-C
    assert "failed" not in err and "exited with code" not in err, err


def test_a_second_ctrl_c_stops_the_workers_at_once(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "hang")
    try:
        _wait_ready(tmp_path, 2, proc)
        proc.send_signal(signal.SIGINT)
        for r in range(2):
            wait_for_file(tmp_path / f"signalled{r}", proc, what=f"worker rank {r} getting the first Ctrl-C")
        assert proc.poll() is None  # the first waits for the step
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)  # the workers' step never ends: only the launcher's SIGKILL ends the run
    finally:
        kill_group(proc)
    assert proc.returncode == 130


def test_the_rank_killed_first_is_named_on_its_own_line(tmp_path: Path) -> None:
    """Rank 0, stopped by the launcher after rank 1 died, is not the one to blame; the message does not
    continue the progress bar's line."""
    proc = _launch(tmp_path, "killed")
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    assert proc.returncode != 0
    assert "\ndiffpipe: worker rank 1 was killed by SIGKILL" in err, err
    assert "rank 0" not in err, err
