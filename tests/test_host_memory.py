"""A worker's freed heap memory goes back to the system (engine/host_memory.py), in a fresh process: glibc's malloc
state there is known (the test's own process has freed who knows what before)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# after an 8 MiB tensor is freed glibc's growing threshold serves tensors up to 8 MiB from its heap: 64 of 1 MiB,
# freed below a 65th that keeps the heap's top in use, stay resident until they are given back (malloc_trim), unless
# the threshold was fixed first (as every worker fixes it), which makes each its own mapping, returned when freed
PROBE = """
import json, sys, torch
from diffpipe_core.engine.host_memory import fix_mmap_threshold, release_freed
from diffpipe_core.engine.memory_report import rss_anon
fixed = fix_mmap_threshold() if sys.argv[1] == "fixed" else None
big = torch.ones(8 << 20, dtype=torch.uint8)
del big
held = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(65)]
top = held.pop()
before = rss_anon()
del held
freed = rss_anon()
released = release_freed()
print(json.dumps({"fixed": fixed, "on_free": before - freed, "released": released, "on_trim": freed - rss_anon()}))
"""


def _probe(how: str, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    out = subprocess.run([sys.executable, "-c", PROBE, how], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim; elsewhere a no-op")
def test_freed_heap_memory_goes_back_to_the_system(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _probe("dynamic", monkeypatch)
    assert result["on_free"] < 8 * 2**20, result  # kept for reuse: the slack a step kept per worker (issue 46)
    assert result["released"] is True
    assert result["on_trim"] >= 56 * 2**20, result  # the 64 freed MiB, less what the allocator keeps in use


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_with_the_threshold_fixed_freed_tensors_leave_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _probe("fixed", monkeypatch)
    assert result["fixed"] is True
    assert result["on_free"] >= 56 * 2**20, result
