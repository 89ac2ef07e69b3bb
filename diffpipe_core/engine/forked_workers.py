"""CPU workers forked from a launcher that imported the training libraries once.

A worker of a short CPU run spends most of its time importing torch, DeepSpeed, diffusers, peft and datasets
(about 12 s on 2 cores), and each of N workers imported them again. On gloo the launcher imports them once
(:func:`preload`) and forks every worker from itself (:func:`fork_worker`), so N workers cost one import.
GPU (NCCL) workers start as fresh processes: CUDA does not work in a child forked after its parent touched it.
``DIFFPIPE_WORKER_START=spawn`` starts CPU workers fresh too.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable

from diffpipe_core.engine.fast_exit import exit_now

START_ENV = "DIFFPIPE_WORKER_START"
START_METHODS = ("fork", "spawn")


def start_method(backend: str) -> str:
    """How workers on ``backend`` start: ``fork`` for gloo on Linux unless ``DIFFPIPE_WORKER_START`` says
    ``spawn``; always ``spawn`` for NCCL and elsewhere."""
    chosen = os.environ.get(START_ENV, "fork")
    if chosen not in START_METHODS:
        raise ValueError(f"{START_ENV}={chosen!r}: expected one of {', '.join(START_METHODS)}")
    return "fork" if chosen == "fork" and backend == "gloo" and sys.platform.startswith("linux") else "spawn"


#: the modules imported when the last :func:`preload` returned (what a forked worker need not import again)
PRELOADED: frozenset[str] = frozenset()


def preload() -> None:
    """Import what every worker imports, silenced as a worker silences it (before the imports)."""
    global PRELOADED
    from diffpipe_core.quiet import library_prints, quiet_libraries

    quiet_libraries(cuda=False)
    with library_prints():
        import deepspeed  # noqa: F401
        import deepspeed.ops.op_builder.builder  # noqa: F401  (ds_patches.guard_op_builds)

        quiet_libraries()  # again: importing DeepSpeed set its logger's level
        import diffpipe_core.data.cache  # noqa: F401  (datasets: ``diffpipe_core.data`` itself imports lazily)
        import diffpipe_core.engine.trainer  # noqa: F401  (peft, DeepSpeed's pipeline engine)
        import diffpipe_core.engine.worker  # noqa: F401
        try:
            import diffusers  # noqa: F401  (every bundled plugin's models)
        except ImportError:
            pass
    PRELOADED = frozenset(sys.modules)


class ForkedWorker:
    """A forked worker, with the part of :class:`subprocess.Popen` the launcher uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def fork_worker(worker_args: list[str], env: dict[str, str], preexec: Callable[[], None] | None) -> ForkedWorker:
    """Fork a worker that runs ``diffpipe_core.engine.worker.main(worker_args)`` with ``env`` as its environment."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # else the child inherits the unwritten buffer and prints it again
    pid = os.fork()
    if pid:
        return ForkedWorker(pid)
    code = 1
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        if preexec is not None:
            preexec()
        import torch

        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # the parent's torch read its own value
        from diffpipe_core.engine.worker import main

        code = main(worker_args)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        exit_now(code, run_atexit=False)
