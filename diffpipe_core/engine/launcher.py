"""Start one worker process per GPU (or ``--num-procs`` CPU workers on gloo) and supervise them.

Workers share the launcher's process group, so killing that group stops everything; each worker also
dies with the launcher (PR_SET_PDEATHSIG on Linux). When one worker fails the others are stopped.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_num_procs(requested: int | None) -> int:
    if requested:
        return requested
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def launch_workers(worker_args: list[str], num_procs: int, log_dir: Path | None = None) -> int:
    """Run ``python -m diffpipe_core.engine.worker *worker_args`` on ``num_procs`` ranks; return the exit code."""
    port = free_port()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    procs: list[subprocess.Popen] = []
    for rank in range(num_procs):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(num_procs),
            LOCAL_WORLD_SIZE=str(num_procs),
            DIFFPIPE_BACKEND=backend,
        )
        cmd = [sys.executable, "-m", "diffpipe_core.engine.worker", *worker_args]
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=preexec))

    def stop_all(sig: int = signal.SIGTERM) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    def on_signal(signum: int, _frame: object) -> None:
        stop_all(signal.SIGTERM)
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(f"diffpipe: worker rank {rank} exited with code {code}; stopping the others", file=sys.stderr)
                stop_all()
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                stop_all(signal.SIGKILL)
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop_all(signal.SIGKILL)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)
