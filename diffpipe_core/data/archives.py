"""Media inside ``.tar`` archives (webdataset style, as diffusion-pipe reads them): each image or video member of a
``.tar`` in a ``[[directory]]`` is an item of its own.

A member is named by a path through its archive, ``folder/shard.tar/member/name.png``: the scan, the scan index,
the cache keys and the decoder take it like any file path, and :func:`open_media` and :func:`stat` are where the
two differ. Its captions come from a ``name.txt`` member beside it in the archive (webdataset's pairing) or from the
directory's ``captions.json``, keyed by the member's name (diffusion-pipe's). Its content key is the member's
size and the archive's mtime: rewriting the archive re-reads its members.
"""

from __future__ import annotations

import io
import os
import stat as stat_module
import tarfile
import threading
from pathlib import Path
from typing import BinaryIO

TAR_EXT = ".tar"
TAR_SEP = TAR_EXT + os.sep  # in the path of every archive member
_OPEN_LIMIT = 8  # archives kept open per process (a scan or an encoder walks one shard after another)


class _Archive:
    """An open archive with its members by name (tarfile reads every header once, on the first lookup)."""

    def __init__(self, path: Path) -> None:
        self.mtime_ns = os.stat(path).st_mtime_ns
        self.tar = tarfile.open(path, "r:")  # noqa: SIM115 - kept open across calls; closed on eviction
        self.members = {m.name.removeprefix("./"): m for m in self.tar.getmembers() if m.isfile()}
        self.lock = threading.Lock()


_open: dict[str, _Archive] = {}
_open_lock = threading.Lock()


def _archive(path: Path) -> _Archive:
    key = str(path)
    with _open_lock:
        found = _open.get(key)
        if found is not None and found.mtime_ns == os.stat(path).st_mtime_ns:
            return found
        if found is not None:
            found.tar.close()
        while len(_open) >= _OPEN_LIMIT:
            _open.pop(next(iter(_open))).tar.close()
        _open[key] = found = _Archive(path)
        return found


def split(path: str | Path) -> tuple[Path, str] | None:
    """``(archive, member name)`` for a path through a ``.tar`` file, None for a plain file's path."""
    text = str(path)
    if TAR_SEP not in text:
        return None
    head, _, member = text.partition(TAR_SEP)
    archive = Path(head + TAR_EXT)
    while not archive.is_file():  # a folder named like x.tar on the way: look for the next one
        if TAR_SEP not in member:
            return None
        more, _, member = member.partition(TAR_SEP)
        archive = archive / (more + TAR_EXT)
    return archive, member


def members(archive: Path, exts: frozenset[str]) -> list[str]:
    """The names of the archive's file members whose suffix (lower case) is in ``exts``, sorted. Raises
    ``tarfile.TarError`` or ``OSError`` for an archive that cannot be read."""
    names = _archive(archive).members
    return sorted(n for n in names if os.path.splitext(n)[1].lower() in exts and not Path(n).name.startswith("."))


def read_bytes(path: str | Path) -> bytes:
    """The bytes of a file or an archive member. Raises ``OSError`` (``FileNotFoundError`` for a member the
    archive lacks)."""
    member = split(path)
    if member is None:
        return Path(path).read_bytes()
    archive = _archive(member[0])
    info = archive.members.get(member[1])
    if info is None:
        raise FileNotFoundError(f"{path}: {member[0]} has no member {member[1]!r}")
    with archive.lock:
        f = archive.tar.extractfile(info)
        assert f is not None  # a file member
        return f.read()


def open_media(path: str | Path) -> str | BinaryIO:
    """What Pillow or PyAV should open: the path of a plain file, the bytes of a member."""
    return str(path) if split(path) is None else io.BytesIO(read_bytes(path))


def member_text(path: str | Path) -> str | None:
    """The text of the ``.txt`` member beside an archive member (webdataset's caption), None if there is none."""
    member = split(path)
    if member is None:
        return None
    name = os.path.splitext(member[1])[0] + ".txt"
    if name not in _archive(member[0]).members:
        return None
    from diffpipe_core.data.captions import decode_caption

    return decode_caption(read_bytes(Path(f"{member[0]}{os.sep}{name}")), name)


class _MemberStat:
    """The ``os.stat`` fields the scan index reads, for an archive member."""

    st_mode = stat_module.S_IFREG

    def __init__(self, size: int, mtime_ns: int) -> None:
        self.st_size, self.st_mtime_ns = size, mtime_ns


def stat(path: str | Path) -> os.stat_result | _MemberStat:
    """``os.stat`` of a file; for an archive member its size and the archive's mtime. Raises
    ``FileNotFoundError`` for a member the archive lacks."""
    member = split(path)
    if member is None:
        return os.stat(path)
    archive = _archive(member[0])
    info = archive.members.get(member[1])
    if info is None:
        raise FileNotFoundError(f"{path}: {member[0]} has no member {member[1]!r}")
    return _MemberStat(info.size, archive.mtime_ns)


def beside_archive(path: Path) -> Path:
    """A member's path as if it were a file beside its archive (``f/shard.tar/a/b.png`` -> ``f/a/b.png``): how it
    pairs with masks and control images by relative path and stem. A plain file's path is returned as is."""
    member = split(path)
    return path if member is None else member[0].parent / member[1]
