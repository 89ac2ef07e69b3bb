"""SIGTERM and Ctrl-C in a worker: finish the step, checkpoint, say how to resume, exit 143 (130 for SIGINT).

A scheduler (SLURM, Kubernetes) sends SIGTERM some time before it kills a job. While training, the first SIGTERM
or SIGINT only sets a flag; the ranks agree on it after each step (one tiny all-reduce), write a checkpoint of
that step together, rank 0 prints the ``--resume`` command, and every rank leaves with ``128 + signal``. A second
SIGINT stops the process at once (the default action). Before training starts (loading, caching: resumable
anyway) the first signal stops at once, quietly.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from diffpipe_core.engine.launcher import STOP_CODES, STOP_SIGNALS

__all__ = ["STOP_CODES", "Stopped", "graceful", "install", "requested", "uninstall"]


class Stopped(BaseException):  # noqa: N818 - not an error: the run stopped as asked
    """Raised out of the work when a signal stopped it; ``code`` is the conventional exit code."""

    def __init__(self, signum: int, agreed: bool = False) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.agreed = agreed  # every rank stopped after the same step (and checkpointed it)

    @property
    def code(self) -> int:
        return 128 + self.signum


_requested = 0
_graceful = False


def _handler(signum: int, _frame: object) -> None:
    global _requested
    if not _graceful:
        if _requested:
            return  # already stopping
        _requested = signum
        raise Stopped(signum)
    if not _requested:
        _requested = signum
    if signum == signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends the process at once


def install() -> None:
    """Handle SIGTERM and SIGINT in this (main-thread) process as the module docstring says."""
    for s in STOP_SIGNALS:
        signal.signal(s, _handler)


def uninstall() -> None:
    """Back to the default actions (a signal ends the process), e.g. for the last barrier before exit."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_DFL)


@contextmanager
def graceful() -> Iterator[None]:
    """Within the block a signal waits for :func:`requested` to be asked at the end of a step."""
    global _graceful
    _graceful = True
    try:
        yield
    finally:
        _graceful = False


def requested(device: torch.device) -> int:
    """Collective: the signal any rank received (0: none), the same on every rank."""
    flag = torch.tensor([float(_requested)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())
