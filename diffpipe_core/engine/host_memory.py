"""Give the host memory a worker has freed back to the system, so a stage's resident memory is what it holds.

glibc's ``malloc`` keeps freed memory in its heaps for reuse, and after the first large block is freed it raises
its mmap threshold (up to 32 MiB), so later tensors of up to that size come from the heaps too. Over the steps,
checkpoints and saves of a run a worker's resident memory then grows past what it holds (by 5-9% of a stage's
model memory on the bench's 0.7 B HunyuanVideo, 1 and 2 stages), and the stage plan's estimate, which counts what is
held, falls short. :func:`release_freed` asks glibc to return every free page (``malloc_trim(0)``); the trainer calls
it after building the stage and after every checkpoint and save, where one-off transients are freed. After a step
it calls it only while the memory report is on (``DIFFPIPE_MEMORY_REPORT``: the report's step phases then record
what the stage holds, and ``bench/stage_memory.py`` measures that regime): what a step frees (a CPU run's activations)
the next step allocates again, and once returned every page of it is faulted back in and zeroed (about 25,000 minor
faults, 40-60 ms, per step of the 0.3 s step-time benches on 2 cores). A step's peak resident memory is the same
either way; between steps the heap keeps the step's freed activations for the next. The trim's own cost grows with
what it returns: about 50-75 ms per 100 MB on a loaded 2-core machine (a GPU run's steps free little host memory).

Inside a step the trim cannot help: glibc's dynamic threshold keeps what one micro-batch's forward or backward freed
(up to 32 MiB a chunk) resident for the next, a slack of 44-93 MiB per worker that does not shrink with the stage
(issue 46: it alone kept 2 and 4 stages above half and a quarter of one stage's memory). :func:`fix_mmap_threshold`,
which every worker calls first, fixes the threshold at :data:`MMAP_THRESHOLD` (``mallopt(M_MMAP_THRESHOLD)``, as
``MALLOC_MMAP_THRESHOLD_`` would): every larger allocation is then its own mapping, returned to the system when freed,
and a worker's resident memory follows what it holds. A value the user set in ``MALLOC_MMAP_THRESHOLD_`` stands.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Callable

#: the workers' fixed mmap threshold: an allocation of at least this is its own mapping (glibc's initial value)
MMAP_THRESHOLD = 128 * 2**10
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own setting of the same, read when the process starts


@functools.cache
def _libc(name: str) -> Callable[..., int] | None:
    """``name`` from glibc; None off Linux or where the C library lacks it (musl has neither malloc_trim nor a
    working mallopt)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    return function


def _malloc_trim() -> Callable[[int], int] | None:
    trim = _libc("malloc_trim")
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
    return trim


def threshold_fixable() -> bool:
    """Whether a worker here runs with a fixed mmap threshold: set by the user, or fixable by
    :func:`fix_mmap_threshold` (glibc)."""
    return bool(os.environ.get(ENV)) or (_libc("mallopt") is not None and _libc("malloc_trim") is not None)


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` for this process (unless ``MALLOC_MMAP_THRESHOLD_``
    already set it), so freed tensors go back to the system instead of staying in the heap; False where the C
    library cannot."""
    if os.environ.get(ENV):
        return True
    mallopt = _libc("mallopt")
    if mallopt is None or _libc("malloc_trim") is None:  # not glibc (musl's mallopt does nothing)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1


def release_freed() -> bool:
    """Return the C heap's free pages to the system (glibc); False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
