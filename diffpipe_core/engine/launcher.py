"""Start one worker process per GPU (or ``--num-procs`` CPU workers on gloo) and supervise them.

Workers share the launcher's process group, so killing that group stops everything; each worker also
dies with the launcher (PR_SET_PDEATHSIG on Linux). When one worker fails the others are stopped, and
the failing worker's error is printed once, last: workers write their error to a file the launcher reads,
and a worker whose collective failed only because a peer died stays quiet (exit code ``PEER_FAILED``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PEER_FAILED = 75
"""Exit code of a worker whose communication failed because another worker had died."""

ERROR_DIR_ENV = "DIFFPIPE_ERROR_DIR"

_PEER_FAILURE_MARKS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective or point-to-point failure caused by a peer process going away."""
    text = f"{type(exc).__name__}: {exc}"
    return "DistBackendError" in text or any(mark in text for mark in _PEER_FAILURE_MARKS)


def report_error(rank: int, message: str, detail: str = "") -> None:
    """Hand this worker's error to the launcher (printed once, after all workers stopped); print it
    directly when running without one."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder:
        tmp = Path(folder) / f".rank{rank}.tmp"
        tmp.write_text(f"{message}\n{detail}".rstrip() + "\n")
        tmp.replace(Path(folder) / f"rank{rank}.txt")
    else:
        print(f"diffpipe: rank {rank}: {message}\n{detail}".rstrip(), file=sys.stderr, flush=True)


def _first_error(folder: Path, codes: list[int | None]) -> str:
    for rank in range(len(codes)):
        file = folder / f"rank{rank}.txt"
        if file.is_file():
            return f"diffpipe: worker rank {rank} failed: {file.read_text().rstrip()}"
    rank, code = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0, PEER_FAILED)), (0, codes[0]))
    return f"diffpipe: worker rank {rank} exited with code {code}"


def launched_externally() -> int | None:
    """The world size when this process was started by a launcher (torchrun, DeepSpeed's, a scheduler's
    script) that set ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; None otherwise."""
    env = os.environ
    if all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")) and ERROR_DIR_ENV not in env:
        return int(env["WORLD_SIZE"])
    return None


def hostfile_slots(hostfile: Path) -> int:
    """Total worker slots of a DeepSpeed hostfile (``hostname slots=N`` per line, ``#`` comments)."""
    return sum(hostfile_hosts(hostfile).values())


def hostfile_hosts(hostfile: Path) -> dict[str, int]:
    """``{hostname: slots}`` of a DeepSpeed hostfile; a malformed line is named."""
    hosts: dict[str, int] = {}
    for number, line in enumerate(hostfile.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit():
            raise ValueError(f"{hostfile}:{number}: expected 'hostname slots=N', got {line!r}")
        hosts[parts[0]] = int(parts[1][6:])
    if not sum(hosts.values()):
        raise ValueError(f"{hostfile}: no 'hostname slots=N' lines")
    return hosts


def launch_deepspeed(hostfile: Path, worker_args: list[str]) -> int:
    """Hand the launch to DeepSpeed's multi-node launcher (pdsh/ssh to each host of ``hostfile``); each of its
    processes runs ``python -m diffpipe_core.engine.worker *worker_args``. Returns its exit code.

    A hostfile naming one host launches there without ssh (DeepSpeed would otherwise insist on reaching it)."""
    single_host = ["--no_ssh_check", "--master_addr", "127.0.0.1"] if len(hostfile_hosts(hostfile)) == 1 else []
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", *single_host,
        "--hostfile", str(hostfile), "--master_port", str(free_port()), "--no_local_rank",
        "--module", "diffpipe_core.engine.worker", *worker_args,
    ]  # fmt: skip
    return subprocess.call(cmd)


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
    with tempfile.TemporaryDirectory(prefix="diffpipe-errors-") as errors:
        return _supervise(worker_args, num_procs, Path(errors))


def _supervise(worker_args: list[str], num_procs: int, errors: Path) -> int:
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
        env[ERROR_DIR_ENV] = str(errors)
        if backend == "gloo" and "OMP_NUM_THREADS" not in os.environ:
            # N CPU workers each using every core slow each other down many times over
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // num_procs))
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
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                # give the others a moment to fail on their own (their errors are quiet), then stop them
                deadline = time.monotonic() + 3
                while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                stop_all()
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                stop_all(signal.SIGKILL)
                for p in procs:
                    p.wait()
                codes = [p.returncode for p in procs]
                print(_first_error(errors, codes), file=sys.stderr, flush=True)
                own = [c for c in codes if c not in (0, PEER_FAILED, -signal.SIGTERM)]
                return own[0] if own and own[0] > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop_all(signal.SIGKILL)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)
