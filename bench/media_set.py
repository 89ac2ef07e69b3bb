"""What the data benchmarks share: a large generated image dataset (written once and reused), and how they
measure and print.

``ensure_media_set(folder, n)`` writes ``n`` small PNGs with ``.txt`` captions into ``folder`` in sub-folders
of 10,000 files (three sizes, for three aspect-ratio buckets), unless a finished set of that size is there.
Generating 100,000 takes a minute or two; the default folder is in the system temp folder so that
benchmarks run later reuse it.
"""

from __future__ import annotations

import io
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

SIZES = ((64, 64), (80, 48), (48, 80))
PER_FOLDER = 10_000


def default_folder(n: int) -> Path:
    return Path(tempfile.gettempdir()) / f"diffpipe-bench-media-{n}"


def media_paths(folder: Path, n: int) -> list[Path]:
    """The media files of a set, in generation order."""
    return [folder / f"part{i // PER_FOLDER:03d}" / f"img_{i:07d}.png" for i in range(n)]


def _templates(k: int = 48) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for t in range(k):
        w, h = SIZES[t % len(SIZES)]
        coarse = rng.integers(0, 256, size=(max(2, h // 8), max(2, w // 8), 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(coarse).resize((w, h), Image.BILINEAR).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def ensure_media_set(folder: Path, n: int) -> Path:
    """``folder`` holding ``n`` PNG + caption pairs (generated now unless already complete)."""
    marker = folder / f".complete-{n}"
    if marker.is_file():
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    t0 = time.perf_counter()
    templates = _templates()
    for i, path in enumerate(media_paths(folder, n)):
        if i % PER_FOLDER == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(templates[i % len(templates)])
        path.with_suffix(".txt").write_text(f"a generated picture number {i}, {SIZES[i % 3][0]} wide", "utf-8")
    marker.write_text("ok")
    print(f"generated {n} images with captions in {folder} ({time.perf_counter() - t0:.0f} s)")
    return folder


def cpu_seconds() -> float:
    """CPU seconds used so far by this process and its finished children (workers, subprocesses)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


def load_line() -> str:
    """On a shared machine wall time also counts the other processes' use of the cores: say how busy it was."""
    return (f"load while measuring: {os.getloadavg()[0]:.1f} runnable processes on {len(os.sched_getaffinity(0))} "
            "cores (1-minute average)")
