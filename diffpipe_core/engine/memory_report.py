"""Where a worker's host memory goes, phase by phase: for ``bench/stage_memory.py`` and anyone asking why one
pipeline stage holds more than another.

Off unless ``DIFFPIPE_MEMORY_REPORT`` names a folder; then each rank writes ``rank<N>.json`` there (atomically, after
every phase): its stage, the anonymous RSS (``RssAnon``: memory-mapped weight files don't count) and, once the stage
is built, every live tensor's bytes by what holds it: frozen and trainable weights of the stage, gradients,
optimizer state, DeepSpeed's pipeline buffers, and whatever else is alive ("other", with its largest shapes, so that
a tensor nobody should hold shows up). Each phase also carries the C heap's live and free bytes (glibc's
``mallinfo2``) and ``peak``: the largest RSS since the phase before, sampled every 5 ms by a thread, with the heap's
live and free bytes at that moment, so that a peak inside a step splits into what was held and what the allocator
kept of what was freed (issue 46: on a CPU run the latter is most of the heap overhead the plan counts,
:func:`~diffpipe_core.engine.stage_plan.heap_overhead`).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ENV = "DIFFPIPE_MEMORY_REPORT"
_phases: list[dict[str, Any]] = []
_estimate: dict[str, Any] = {}  # the stage plan's estimate of this stage, once a phase has given it


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def rss_anon(pid: int | str = "self") -> int:
    """Anonymous resident bytes of process ``pid`` (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    if t.device.type == "meta":
        return None
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except RuntimeError:  # a tensor subclass without storage
        return None


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _is_tensor(obj: object) -> bool:
    try:
        return torch.is_tensor(obj)
    except ReferenceError:  # a dead weak proxy
        return False


def tensor_breakdown(model: torch.nn.Module, optimizer: Any = None, engine: Any = None) -> dict[str, Any]:
    """Bytes of every live CPU/GPU tensor of this process, each storage counted once, by what holds it."""
    owners: dict[tuple[str, int], str] = {}

    def claim(t: Any, what: str) -> None:
        if torch.is_tensor(t):
            key = _storage_key(t)
            if key is not None:
                owners.setdefault(key, what)

    for p in model.parameters():
        claim(p, "trainable weights" if p.requires_grad else "frozen weights")
        claim(p.grad, "gradients")
        for attr in ("quant_state",):  # bitsandbytes nf4 block scales
            state = getattr(p, attr, None)
            claim(getattr(state, "absmax", None), "frozen weights")
    for b in model.buffers():
        claim(b, "frozen weights")
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                claim(value, "optimizer state")
    buffers = getattr(engine, "pipe_buffers", None) or {}
    for values in buffers.values():
        for value in values:
            for t in value if isinstance(value, (tuple, list)) else (value,):
                claim(t, "pipeline buffers")
    totals: dict[str, int] = {}
    others: dict[tuple[str, int], torch.Tensor] = {}
    seen: set[tuple[str, int]] = set()
    gc.collect()
    with warnings.catch_warnings():  # is_tensor on torch.distributed's deprecated reduce_op object warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if _is_tensor(obj)]
    for obj in tensors:
        key = _storage_key(obj)
        if key is None or key in seen:
            continue
        seen.add(key)
        what = owners.get(key, "other")
        totals[what] = totals.get(what, 0) + _nbytes(obj)
        if what == "other":
            others[key] = obj
    largest = sorted(others.values(), key=_nbytes, reverse=True)[:5]
    return {
        "bytes": totals,
        "largest_other": [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} {_nbytes(t)}" for t in largest],
    }


def record(phase: str, stage_id: int, model: torch.nn.Module | None = None, optimizer: Any = None,
           engine: Any = None, estimate: Any = None) -> None:
    """Append one phase to this rank's report (no-op unless ``DIFFPIPE_MEMORY_REPORT`` is set); ``estimate`` (the
    stage plan's :class:`~diffpipe_core.engine.stage_plan.StageEstimate` of this stage) is stored beside it and kept
    for the later phases, which record the anonymous RSS alone."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    # wall-clock time, so a sampler outside (bench/stage_memory.py) can tell which phase its peak fell in
    start_peak_sampler()
    entry: dict[str, Any] = {"phase": phase, "rss_anon": rss_anon(), "time": time.time()}
    got = heap()
    if got is not None:
        entry["heap_live"], entry["heap_free"] = got
    # the largest RSS since the last phase (the sampler's: this phase's peak), with the C heap's live and free bytes
    # at that moment
    with _peak_lock:
        entry["peak"] = {k: _peak[k] for k in ("rss_anon", "heap_live", "heap_free") if k in _peak}
        _peak["rss_anon"] = 0
    if model is not None:
        entry.update(tensor_breakdown(model, optimizer, engine))
    _phases.append(entry)
    if estimate is not None:
        _estimate.update({
            key: getattr(estimate, key)
            for key in ("start", "stop", "params", "weight_bytes", "host_bytes", "state_bytes", "activation_bytes",
                        "transient_bytes", "in_flight", "save_bytes", "micro_batch_bytes", "heap_bytes", "peak_bytes")
        })  # fmt: skip
    report: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "stage": stage_id, "phases": _phases}
    if _estimate:
        report["estimate"] = _estimate
    path = Path(folder) / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)


# ------------------------------------------------------------------------------------------------ the C heap


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def heap() -> tuple[int, int] | None:
    """The C heap as glibc's ``mallinfo2`` sees it, every arena: (bytes handed out and not had back, mmapped chunks
    included; free bytes in its arenas). The first is what is live; the second is what it keeps for reuse, resident
    or not (pages ``malloc_trim`` gave back stay free chunks of the arena). None elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd), int(info.fordblks)


_peak: dict[str, Any] = {}  # the sampler's peak since the last phase: rss_anon, heap_live, heap_free


_peak_lock = threading.Lock()


def sample_peak() -> None:
    """One look: a new largest anonymous RSS since the last phase is kept with the C heap's live and free bytes."""
    # one look at a time: a look that read the RSS, then read the heap after memory was freed, must not overwrite a
    # larger look taken in between (the sampling thread and a caller race otherwise)
    with _peak_lock:
        rss = rss_anon()
        if rss > _peak.get("rss_anon", 0) + (1 << 20):
            got = heap() or (0, 0)
            _peak.update(rss_anon=rss, heap_live=got[0], heap_free=got[1])


def _sample_peak(interval: float = 0.005) -> None:
    while True:
        sample_peak()
        time.sleep(interval)


def start_peak_sampler() -> None:
    """Start the thread :func:`record` reads the peak from (once; with the report only)."""
    if enabled() and "thread" not in _peak:
        _peak["thread"] = threading.Thread(target=_sample_peak, daemon=True, name="memory-peak")
        _peak["thread"].start()
