"""Atomic file and folder writes: write beside the target, then rename over it.

A process killed mid-write leaves the previous file (or folder) intact and at worst a ``.tmp-*``
leftover, which the next write replaces.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (changing it races other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temp_beside(path: Path) -> tuple[int, str]:
    """A temporary file beside ``path`` with the permissions a normal new file gets (``mkstemp`` makes it
    0600, which would hide saved LoRAs from a ComfyUI running as another user)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}.")
    os.fchmod(fd, 0o666 & ~current_umask())
    return fd, tmp


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    fd, tmp = _temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_save_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    fd, tmp = _temp_beside(path)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, 0o666 & ~current_umask())  # safetensors writes through its own 0600 temporary file
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        code = re.search(r"\(os error (\d+)\)", str(exc)) if not isinstance(exc, OSError) else None
        if code:  # safetensors reports a failed write as SafetensorError; keep it an OSError with its errno
            raise OSError(int(code.group(1)), f"{path}: {exc}") from exc
        raise
    _fsync_dir(path.parent)


def replace_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Move a fully written ``tmp_dir`` to ``final_dir``, replacing an older one as late as possible.

    Its files get the permissions the umask gives a normal file first: libraries that wrote them (safetensors,
    diffusers' ``save_pretrained``) leave 0600, which other users and containers cannot read."""
    mode = 0o666 & ~current_umask()
    for file in tmp_dir.rglob("*"):
        if file.is_file() and not file.is_symlink():
            os.chmod(file, mode)
    old = None
    if final_dir.exists():
        old = final_dir.with_name(f".old-{final_dir.name}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    _fsync_dir(final_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class NoSpaceError(OSError):
    """A save that did not fit on its disk; the message names the folder and the sizes."""

    def __str__(self) -> str:
        return str(self.strerror)


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


@contextlib.contextmanager
def space_checked(tmp_dir: Path, needed: int, what: str, kept: str) -> Iterator[None]:
    """Around writes into ``tmp_dir`` (about ``needed`` bytes): on a full disk (or quota), remove ``tmp_dir`` and
    raise one OSError naming the folder, what was needed and what is free, and ``kept`` (what stays intact)."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in NO_SPACE:
            raise
        shutil.rmtree(tmp_dir, ignore_errors=True)
        try:
            free = human_bytes(shutil.disk_usage(tmp_dir.parent).free)
        except OSError:
            free = "unknown"
        raise NoSpaceError(
            exc.errno,
            f"no space left on the device of {tmp_dir.parent} while writing {what}: it needs about "
            f"{human_bytes(needed)}, {free} is free; removed the partial {tmp_dir.name}, {kept}",
        ) from None


def file_digest(path: Path) -> dict[str, int | str]:
    """``{"sha256": hex, "bytes": size}`` of a file."""
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"sha256": digest, "bytes": path.stat().st_size}
