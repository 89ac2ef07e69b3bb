"""Who is using a cache folder, so that nothing deletes one another process may be reading; and whose turn it
is to encode into it.

A process using an encoder-fingerprint folder holds a *lease*: a file in ``<fp_dir>/.users/`` that it keeps
locked (``flock``) until it exits; a lease whose lock can be taken belongs to a process that has ended. Taking
a lease and deleting a folder both happen under the dataset cache root's *gate* lock, so a folder is never
deleted between another process's check and its lease. One lease per run is enough: rank 0 takes it, and the
launcher stops every rank when one ends.

Two runs caching the same folder at once take turns (:func:`encoding_turn`): the second waits for the first to
finish encoding, then encodes only what is still missing, so nothing is encoded or stored twice.
"""

from __future__ import annotations

import fcntl
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

USERS = ".users"
GATE = ".gate.lock"

# This process's leases: folder -> (lease file, open descriptor holding its lock). Released at exit.
_leases: dict[Path, tuple[Path, int]] = {}


@contextmanager
def gate(root: Path) -> Iterator[None]:
    """Exclusive lock on a dataset's cache root while leases are taken or folders deleted."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / GATE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def take_lease(fp_dir: Path) -> None:
    """Mark ``fp_dir`` as in use by this process until it exits. Call under :func:`gate` of its root."""
    users = fp_dir / USERS
    users.mkdir(parents=True, exist_ok=True)
    key = fp_dir.resolve()
    if key in _leases:
        if _leases[key][0].exists():
            return
        os.close(_leases.pop(key)[1])  # the folder was deleted and made again (regenerate)
    lease = users / f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(lease, os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _leases[key] = (lease, fd)


def _own_lease_names() -> set[str]:
    return {lease.name for lease, _ in _leases.values()}


def other_users(fp_dir: Path) -> list[str]:
    """The leases of other live processes on ``fp_dir`` (their file names: host-pid-id). Leases of ended
    processes are removed on the way. Call under :func:`gate`."""
    users = fp_dir / USERS
    if not users.is_dir():
        return []
    own = _own_lease_names()
    live = []
    for lease in sorted(users.iterdir()):
        if lease.name in own:
            continue
        try:
            fd = os.open(lease, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            live.append(lease.name)
        else:
            lease.unlink(missing_ok=True)  # its process has ended
        finally:
            os.close(fd)
    return live


def in_use(fp_dir: Path) -> bool:
    """Whether another live process holds a lease on ``fp_dir``. Call under :func:`gate`."""
    return bool(other_users(fp_dir))


ENCODING = ".encoding.lock"

# This process's encoding turns: folder -> descriptor holding the lock (kept after an error, reused next time).
_turns: dict[Path, int] = {}


def encoding_turn(fp_dir: Path, say: Callable[[str], None]) -> None:
    """Block until no other process encodes into ``fp_dir``, then hold that right until :func:`end_encoding_turn`
    (or this process exits). Says once, naming the holder, when it has to wait."""
    key = fp_dir.resolve()
    if key in _turns:
        return
    fp_dir.mkdir(parents=True, exist_ok=True)
    path = fp_dir / ENCODING
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        say(f"{fp_dir}: {holder} is encoding into this cache; waiting for it, to reuse what it encodes")
        fcntl.flock(fd, fcntl.LOCK_EX)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}".encode(), 0)
    _turns[key] = fd


def end_encoding_turn(fp_dir: Path) -> None:
    fd = _turns.pop(fp_dir.resolve(), None)
    if fd is not None:
        os.close(fd)
