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
Within a step a CPU run's engine calls it before every pipeline instruction (``ds_patches`` patch 12): there the
freed memory of one micro-batch sits beside the activations of the others in flight, at the stage's peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl and other C libraries have no malloc_trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed() -> bool:
    """Return the C heap's free pages to the system (glibc); False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
