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
from collections.abc import Callable
from pathlib import Path
from typing import Any

PEER_FAILED = 75
"""Exit code of a worker whose communication failed because another worker had died."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_CODES = tuple(128 + s for s in STOP_SIGNALS)
"""Exit codes of a worker that a signal stopped (diffpipe_core.engine.stopping)."""
STOPPED = (0, PEER_FAILED, *STOP_CODES, *(-s for s in STOP_SIGNALS))
"""How workers end when a run is stopped by a signal: done, stopped, or let down by a stopped peer."""

ERROR_DIR_ENV = "DIFFPIPE_ERROR_DIR"
STOP_SIGNAL_FILE = "stop-signal"
"""In the error folder: the name of the signal the launcher received and passed on to the workers as SIGTERM."""


def stop_signal_name(signum: int) -> str:
    """The name of the signal that stopped this worker: the one the launcher received when it passed one on."""
    folder = os.environ.get(ERROR_DIR_ENV)
    record = Path(folder) / STOP_SIGNAL_FILE if folder else None
    if record is not None and record.is_file():
        return record.read_text().strip()
    return signal.Signals(signum).name

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


def _first_error(folder: Path, codes: list[int | None], first: int) -> str:
    """The error of the rank that failed first (``first``, the one whose exit was seen first): its report, or how
    it ended when a signal ended it or nobody left a report, else the lowest rank's report."""
    reports = [r for r in range(len(codes)) if (folder / f"rank{r}.txt").is_file()]
    code = codes[first]
    signalled = code is not None and (code < 0 or code in STOP_CODES)
    if first not in reports and (signalled or not reports):
        if code is not None and code < 0:
            return f"diffpipe: worker rank {first} was killed by {signal.Signals(-code).name}"
        if signalled:
            return f"diffpipe: worker rank {first} was stopped by {signal.Signals(code - 128).name}"
        return f"diffpipe: worker rank {first} exited with code {code}"
    rank = first if first in reports else reports[0]
    return f"diffpipe: worker rank {rank} failed: {(folder / f'rank{rank}.txt').read_text().rstrip()}"


def _blame(code: int) -> int:
    """Which of several failed workers brought the others down: killed or stopped by a signal (0) before failed
    on its own (1) before failed because a peer died (2)."""
    return 0 if code < 0 or code in STOP_CODES else 2 if code == PEER_FAILED else 1


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
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


WORKER = (sys.executable, "-m", "diffpipe_core.engine.worker")


def launch_workers(
    worker_args: list[str], num_procs: int, worker: tuple[str, ...] = WORKER, backend: str | None = None
) -> int:
    """Run ``python -m diffpipe_core.engine.worker *worker_args`` (or ``worker *worker_args``) on ``num_procs``
    ranks (``backend``: default NCCL with GPUs, else gloo); return the exit code."""
    if backend is None:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    from diffpipe_core.engine.forked_workers import fork_worker, preload, start_method

    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    if worker == WORKER and start_method(backend) == "fork":
        preload()

        def start(env: dict[str, str]) -> Any:
            return fork_worker(worker_args, env, preexec)
    else:

        def start(env: dict[str, str]) -> Any:
            return subprocess.Popen([*worker, *worker_args], env=env, preexec_fn=preexec)

    with tempfile.TemporaryDirectory(prefix="diffpipe-errors-") as errors:
        return _supervise(start, num_procs, Path(errors), backend)


def local_rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The torch.distributed environment of ``rank`` among ``world`` processes on this machine, rendezvous at
    ``127.0.0.1:port``."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
    }


def _supervise(start: Callable[[dict[str, str]], Any], num_procs: int, errors: Path, backend: str) -> int:
    """Start ``num_procs`` ranks with ``start(environment)`` (a :class:`subprocess.Popen` or a forked worker) and
    watch them until all are done, one failed, or a signal stopped them; return the run's exit code."""
    port = free_port()
    procs: list[Any] = []
    for rank in range(num_procs):
        env = dict(os.environ)
        env.update(local_rank_env(rank, num_procs, port), DIFFPIPE_BACKEND=backend)
        env[ERROR_DIR_ENV] = str(errors)
        if backend == "gloo" and "OMP_NUM_THREADS" not in os.environ:
            # N CPU workers each using every core slow each other down many times over
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // num_procs))
        procs.append(start(env))

    def stop_all(sig: int = signal.SIGTERM) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        """The first SIGTERM or SIGINT asks the workers to checkpoint and stop (the tty's Ctrl-C reached them
        already; a scheduler's SIGTERM may have reached only us); a second SIGINT stops them at once."""
        if received and signum == signal.SIGINT:
            stop_all(signal.SIGKILL)
            raise KeyboardInterrupt
        if not received:
            received.append(signum)
            # SIGTERM to every worker (a second SIGINT would end one that Ctrl-C reached too), with the name of
            # the one that came, for their "stopped by" line
            record = errors / ".stop-signal.tmp"
            record.write_text(signal.Signals(signum).name)
            record.replace(errors / STOP_SIGNAL_FILE)
            stop_all(signal.SIGTERM)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes):
                return 0
            stopping = received or any(c in STOP_CODES for c in codes)  # each worker checkpoints, then exits
            if stopping and all(c is None or c in STOPPED for c in codes):
                if any(c is None for c in codes):
                    time.sleep(0.2)
                    continue
                if received:
                    return 128 + received[0]
                rank, code = next((r, c) for r, c in enumerate(codes) if c in STOP_CODES)
                print(f"diffpipe: worker rank {rank} was stopped by {signal.Signals(code - 128).name}",
                      file=sys.stderr, flush=True)
                return code
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # the one that brought the others down: killed, else failed on its own, else a peer's victim
                first = min(failed, key=lambda r: (_blame(codes[r]), r))
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
                print("\n" + _first_error(errors, codes, first), file=sys.stderr, flush=True)
                own = [c for c in codes if c not in (0, PEER_FAILED, -signal.SIGTERM)]
                return own[0] if own and own[0] > 0 else 1
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop_all(signal.SIGKILL)
        return 128 + signal.SIGINT
    finally:
        for s, h in old.items():
            signal.signal(s, h)
