"""The scan index: what each media and caption file told the last scan, so a re-scan costs one ``stat`` a file.

Kept beside the cache, ``<cache_dir>/scan/<dataset TOML stem>-<hash>.json``. For every file of the last
scan (grouped by folder) it holds ``[size, mtime_ns, sha256 or null, kind, *facts]``: an image's displayed
width and height (EXIF orientation applied), a video's width, height, duration and frame rate, a caption
file's text, or why the file could not be read. The facts do not depend on the model or the bucketing
settings, which are applied afresh on every scan.

A file whose size and mtime (and, with ``strict``, content hash) match its entry is not opened again; a
changed or new file is read, and a removed one drops out of the index when it is saved. New files are read
on all cores when there are many (worker processes); a few are read in-process. An index that is corrupt,
or was written by another format or diffpipe version, is never trusted: it is rebuilt with a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from diffpipe_core import __version__
from diffpipe_core.data import archives, captions, decode
from diffpipe_core.data.cache_keys import file_content_key

log = logging.getLogger("diffpipe.data")

INDEX_FORMAT = 1  # bump when the entry layout or what a probe records changes
POOL_MIN_FILES = 5000  # fewer new files than this are read in-process: starting the workers costs about a second

IMAGE, VIDEO, TEXT = "image", "video", "text"
# kinds stored in an entry: what the file is, or why it could not be read
_MEDIA_OK = {IMAGE: "i", VIDEO: "v"}
_ERROR, _EMPTY, _TEXT_OK, _TEXT_ERROR = "x", "0", "t", "tx"
_VIDEO_FIELDS = tuple(f.name for f in dataclasses.fields(decode.VideoInfo))
# what an index must have been written with to be trusted (a new VideoInfo field is a new version, too)
_HEADER = (INDEX_FORMAT, __version__, list(_VIDEO_FIELDS))


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building large acyclic structures (a scan of 100,000 files,
    a cache index of 100,000 entries): the collections their millions of allocations trigger would cost a
    fifth of a re-scan, and they free nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def index_path(cache_dir: Path | None, source: Path | None, roots: Iterable[Path]) -> Path | None:
    """Where the scan index of a dataset lives: ``<cache_dir>/scan/<TOML stem>-<hash of its path>.json``
    (None without a cache folder)."""
    if cache_dir is None:
        return None
    ident = str(Path(source).resolve()) if source is not None else "\0".join(sorted(str(r) for r in roots))
    stem = Path(source).stem if source is not None else "dataset"
    return Path(cache_dir) / "scan" / f"{stem}-{hashlib.sha256(ident.encode()).hexdigest()[:8]}.json"


def _sha256(path: str) -> str:
    return file_content_key(Path(path), strict=True)


def read_file(path: str, kind: str, size: int | None = None, mtime_ns: int | None = None) -> list[Any]:
    """Read one file: the index entry ``[size, mtime_ns, None, kind, ...]`` for it.

    ``kind`` is ``"image"``, ``"video"`` or ``"text"``; ``size`` and ``mtime_ns`` come from a ``stat`` made
    before this read (made now if not given). Never raises for an unreadable file: the entry records why.
    Raises ``OSError`` only when the file cannot be stat'ed.
    """
    if size is None or mtime_ns is None:
        st = archives.stat(path)
        size, mtime_ns = st.st_size, st.st_mtime_ns
    head: list[Any] = [size, mtime_ns, None]
    if kind == TEXT:
        try:
            return [*head, _TEXT_OK, captions.read_caption(Path(path))]
        except (ValueError, OSError) as exc:
            return [*head, _TEXT_ERROR, str(exc)]
    if size == 0:
        return [*head, _EMPTY]
    try:
        if kind == VIDEO:
            info = decode.probe_video(Path(path))
            return [*head, _MEDIA_OK[VIDEO], *(getattr(info, f) for f in _VIDEO_FIELDS)]
        w, h = decode.probe_image(Path(path))
        return [*head, _MEDIA_OK[IMAGE], w, h]
    except decode.MediaError as exc:
        return [*head, _ERROR, getattr(exc, "kind", "unreadable"), str(exc)]


# entry length by kind: [size, mtime_ns, sha256 or None, kind, *facts]
_TAGS = {IMAGE: ("i", _ERROR, _EMPTY), VIDEO: ("v", _ERROR, _EMPTY), TEXT: (_TEXT_OK, _TEXT_ERROR)}
_LENGTH = {"i": 6, "v": 4 + len(_VIDEO_FIELDS), _ERROR: 6, _TEXT_OK: 5, _TEXT_ERROR: 5, _EMPTY: 4}
_FACT_TYPES = {"i": (int,), "v": (int, float, type(None))}  # the other kinds' facts are strings


def _invalid(entries: dict[str, Any]) -> str | None:
    """The first path whose entry is malformed, or None. Runs over every entry of a loaded index (so a
    damaged index is never partly trusted), hence written for speed."""
    length, fact_types, strings = _LENGTH.get, _FACT_TYPES.get, (str,)
    for key, e in entries.items():
        if type(e) is not list or len(e) < 4 or type(e[3]) is not str or length(e[3]) != len(e):
            return key
        if type(e[0]) is not int:
            return key
        if type(e[1]) is not int or not (e[2] is None or type(e[2]) is str):
            return key
        want = fact_types(e[3], strings)
        for v in e[4:]:
            if type(v) not in want:
                return key
    return None


class ScanIndex:
    """The scan index of one dataset for one scan: entries loaded from disk, and those of this scan.

    Call :meth:`prefetch` with every candidate file first (that is where new files are read, in parallel),
    then :meth:`media`, :meth:`caption` and :meth:`content_key` per file, then :meth:`save`.
    ``stats`` counts files ``read`` (decoded or probed), ``reused`` and ``removed`` (since the last save).
    """

    def __init__(self, path: Path | None, strict: bool = False) -> None:
        self.path = path
        self.strict = strict
        self.old: dict[str, list[Any]] = {}
        self.new: dict[str, list[Any]] = {}
        self.missing: set[str] = set()
        self.stats = {"read": 0, "reused": 0, "removed": 0, "rebuilt": 0}
        if path is not None:
            self.old = self._load(path)

    # ------------------------------------------------------------------------------------------ disk
    def _load(self, path: Path) -> dict[str, list[Any]]:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            return self._rebuild(path, f"cannot be read ({exc})")
        try:
            data = json.loads(raw)
        except ValueError as exc:
            return self._rebuild(path, f"is corrupt (not JSON: {exc})")
        if not isinstance(data, dict) or not isinstance(data.get("folders"), dict):
            return self._rebuild(path, "is corrupt (no folders table)")
        if (data.get("format"), data.get("diffpipe"), data.get("video_facts")) != _HEADER:
            return self._rebuild(
                path,
                f"was written by another version (format {data.get('format')!r}, diffpipe {data.get('diffpipe')!r}; "
                f"this is format {INDEX_FORMAT}, diffpipe {__version__})",
            )
        try:
            entries = {f"{folder}{os.sep}{name}": e for folder, files in data["folders"].items()
                       for name, e in files.items()}
        except (AttributeError, TypeError):
            return self._rebuild(path, "is corrupt (a folder is not a table)")
        bad = _invalid(entries)
        if bad is not None:
            return self._rebuild(path, f"is corrupt (bad entry for {bad})")
        return entries

    def _rebuild(self, path: Path, why: str) -> dict[str, list[Any]]:
        log.warning("scan index %s %s; not using it: every file is read again and the index rebuilt", path, why)
        self.stats["rebuilt"] = 1
        return {}

    def save(self) -> None:
        """Write this scan's entries (atomically) if any file was added, changed or removed."""
        self.stats["removed"] = len(self.old.keys() - self.new.keys())
        if self.path is None or (self.new == self.old and not self.stats["rebuilt"]):
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".tmp-{self.path.name}-{uuid.uuid4().hex[:8]}")
        try:
            folders: dict[str, dict[str, list[Any]]] = {}
            for key, entry in self.new.items():
                folder, _, name = key.rpartition(os.sep)
                folders.setdefault(folder, {})[name] = entry
            payload = dict(zip(("format", "diffpipe", "video_facts"), _HEADER), folders=folders)
            tmp.write_text(json.dumps(payload, separators=(",", ":")), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:  # a read-only cache folder costs speed, not correctness
            tmp.unlink(missing_ok=True)
            log.warning("could not write the scan index %s (%s); the next scan reads every file again", self.path, exc)

    # ------------------------------------------------------------------------------------------ lookups
    def _reusable(self, key: str, st: os.stat_result, kind: str) -> list[Any] | None:
        old = self.old.get(key)
        if old is None or old[0] != st.st_size or old[1] != st.st_mtime_ns or old[3] not in _TAGS[kind]:
            return None
        if self.strict and kind != TEXT and old[2] != _sha256(key):
            return None
        return old

    def _store(self, key: str, entry: list[Any], read: bool) -> list[Any]:
        if self.strict and entry[3] != _TEXT_OK and entry[3] != _TEXT_ERROR and entry[2] is None:
            entry[2] = _sha256(key)
        self.new[key] = entry
        self.stats["read" if read else "reused"] += 1
        return entry

    def _entry(self, path: str | Path, kind: str) -> list[Any] | None:
        """This scan's entry for a file (stat'ed and read now if :meth:`prefetch` did not); None if it is not
        there. Raises ``OSError`` if it cannot be stat'ed for another reason."""
        key = str(path)
        entry = self.new.get(key)
        if entry is not None or key in self.missing:
            return entry
        try:
            st = archives.stat(key)
        except (FileNotFoundError, NotADirectoryError):
            self.missing.add(key)
            return None
        if kind == TEXT and not stat.S_ISREG(st.st_mode):  # a folder named like a caption is no caption
            self.missing.add(key)
            return None
        old = self._reusable(key, st, kind)
        if old is not None:
            return self._store(key, old, False)
        return self._store(key, read_file(key, kind, st.st_size, st.st_mtime_ns), True)

    def media(self, path: str | Path, kind: str) -> tuple[int, tuple[int, int] | decode.VideoInfo | None]:
        """``(size, facts)`` of a media file: ``(width, height)`` for an image, a ``VideoInfo`` for a video,
        None for an empty file. Raises ``OSError`` (cannot stat) or ``MediaError`` (as the probe did)."""
        entry = self._entry(path, kind)
        if entry is None:
            raise FileNotFoundError(f"{path}: no such file")
        tag = entry[3]
        if tag == _EMPTY:
            return entry[0], None
        if tag == _ERROR:
            err = decode.MediaError(entry[5])
            if entry[4] != "unreadable":
                err.kind = entry[4]  # type: ignore[attr-defined]
            raise err
        if tag == "v":
            return entry[0], decode.VideoInfo(*entry[4:])
        return entry[0], (entry[4], entry[5])

    def caption(self, path: str | Path) -> str | None:
        """The text of a caption file, None if there is none. Raises ``ValueError`` for an unreadable one."""
        entry = self._entry(path, TEXT)
        if entry is None:
            return None
        if entry[3] == _TEXT_ERROR:
            raise ValueError(entry[4])
        return entry[4]

    def content_key(self, path: str | Path) -> str:
        """The media content key of a file this scan has stat'ed (``size:mtime_ns``, or its hash in strict
        mode): the key the cache uses (:func:`diffpipe_core.data.cache_keys.file_content_key`)."""
        entry = self.new.get(str(path))
        if entry is None:
            return file_content_key(Path(path), self.strict)
        if self.strict:
            return entry[2] if entry[2] is not None else file_content_key(Path(path), True)
        return file_content_key(path, False, size_mtime=(entry[0], entry[1]))

    # ------------------------------------------------------------------------------------------ first reads
    def prefetch(self, files: list[tuple[str, str]], absent: Iterable[str] = (), workers: int | None = None,
                 progress: bool = True) -> None:
        """Stat every ``(path, kind)``; read the files that are new or changed, in a pool of ``workers``
        processes (default: every core) when there are at least ``POOL_MIN_FILES`` of them. ``absent`` are
        paths known not to exist (captions the folder listing lacks), so they are not stat'ed."""
        self.missing.update(map(str, absent))
        todo: list[tuple[str, str, int, int]] = []  # (path, kind, size, mtime_ns): the stat the read follows
        new, old_get, stat_ = self.new, self.old.get, archives.stat
        reused = 0
        for key, kind in files:
            if key in new:
                continue
            try:
                st = stat_(key)
            except OSError:
                continue  # reported by the per-file lookup
            old = old_get(key)
            # the common case inline (a re-scan of 100,000 unchanged files spends its time here)
            if old is not None and not self.strict and old[0] == st.st_size and old[1] == st.st_mtime_ns \
                    and old[3] in _TAGS[kind]:
                new[key] = old
                reused += 1
            elif old is not None and self._reusable(key, st, kind) is not None:
                self._store(key, old, False)
            else:
                todo.append((key, kind, st.st_size, st.st_mtime_ns))
        self.stats["reused"] += reused
        if not todo:
            return
        n = workers if workers is not None else _cores()
        bar = tqdm(total=len(todo), desc="reading new files", unit="file", leave=False,
                   disable=not progress or len(todo) < 200)
        try:
            if n > 1 and len(todo) >= POOL_MIN_FILES:
                try:
                    for key, entry in _read_in_workers(todo, n, bar.update):
                        if entry is not None:
                            self._store(key, entry, True)
                    todo = []
                except (OSError, RuntimeError) as exc:
                    log.warning("reading new files in %d processes failed (%s); reading them here instead", n, exc)
            if todo:
                for key, kind, size, mtime_ns in todo:
                    if key in self.new:
                        continue
                    try:
                        self._store(key, read_file(key, kind, size, mtime_ns), True)
                    except OSError:
                        pass  # vanished since the stat; the per-file lookup reports it
                    bar.update(1)
        finally:
            bar.close()


def _cores() -> int:
    """The cores this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every core
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def _read_in_workers(todo: list[tuple[str, str, int, int]], n: int, advance: Any) -> list[tuple[str, list[Any] | None]]:
    """Read files in ``n`` worker processes, each a fresh interpreter running :func:`_worker_main` on an
    interleaved share. Not multiprocessing: its workers would re-import the caller's main module (a training
    worker imports torch and DeepSpeed), and fork would copy a training worker's threads mid-flight."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    shares = [todo[i::n] for i in range(n)]
    results: list[list[list[Any] | None]] = [[] for _ in shares]
    errors: list[str] = []
    lock = threading.Lock()
    logs = [tempfile.TemporaryFile("w+") for _ in shares]  # a file, not a pipe: chatty stderr cannot block it
    procs = [
        subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=log, env=env, text=True, start_new_session=True)
        for log in logs
    ]

    def pump(k: int) -> None:
        proc = procs[k]
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(shares[k]))
            proc.stdin.close()
            for line in proc.stdout:  # one line per chunk of files
                chunk = json.loads(line)
                results[k].extend(chunk)
                with lock:
                    advance(len(chunk))
            if proc.wait() != 0 or len(results[k]) != len(shares[k]):
                logs[k].seek(0)
                errors.append(logs[k].read().strip()[-2000:] or f"exit status {proc.returncode}")
        except Exception as exc:  # reported below, after every worker is stopped
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=pump, args=(k,), daemon=True) for k in range(len(shares))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for proc, log in zip(procs, logs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
    if errors:
        raise RuntimeError(f"a scan worker failed: {errors[0]}")
    return [(job[0], entry) for share, got in zip(shares, results) for job, entry in zip(share, got)]


# A worker: reads a JSON list of [path, kind, size, mtime_ns] on stdin and writes the entries (null where a file
# vanished) in order, one JSON list per chunk of files and line.
_WORKER = "from diffpipe_core.data.scan_index import _worker_main; _worker_main()"
_CHUNK = 256


def _worker_main() -> None:
    chunk: list[list[Any] | None] = []
    for path, kind, size, mtime_ns in json.load(sys.stdin):
        try:
            chunk.append(read_file(path, kind, size, mtime_ns))
        except OSError:
            chunk.append(None)
        if len(chunk) == _CHUNK:
            sys.stdout.write(json.dumps(chunk) + "\n")
            sys.stdout.flush()
            chunk = []
    if chunk:
        sys.stdout.write(json.dumps(chunk) + "\n")
    sys.stdout.flush()
