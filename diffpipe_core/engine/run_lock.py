"""One writer per run folder: the process that trains into a run folder holds ``<run>/.writer.lock`` (``flock``)
until it exits, so a second ``diffpipe train --resume`` of the same run is refused, naming the first. The kernel
drops the lock when its process ends, however it ends, so a lock left by a killed run is stale and simply taken.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

WRITER_LOCK = ".writer.lock"

# This process's locks: run folder -> descriptor holding it (inherited by forked workers; released at exit).
_held: dict[Path, int] = {}


class RunFolderBusy(OSError):
    """Another live process is writing into the run folder."""


def hold_run_folder(run_dir: Path) -> None:
    """Become the one writer of ``run_dir`` until this process exits; raise :class:`RunFolderBusy` naming the
    writer when another live process is one."""
    key = run_dir.resolve()
    if key in _held:
        return
    fd = os.open(key / WRITER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunFolderBusy(
            f"{key} is being written by another diffpipe run ({holder}); a run folder has one writer: wait for "
            "that run to end (or stop it), or train a new run without --resume"
        ) from None
    os.ftruncate(fd, 0)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}".encode(), 0)
    _held[key] = fd
