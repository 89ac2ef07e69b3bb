"""The suite's own scheduling (the repository's ``conftest.py``): measured durations per module, and the queue that
hands xdist the longest group first."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_queue_hands_out_the_longest_unit_first_and_keeps_xdist_order_for_the_rest() -> None:
    queue = _load(ROOT / "conftest.py", "suite_conftest").LongestFirst({"a": 1.0, "b": 30.0, "c": 5.0}.get)
    for scope in "abc":
        queue[scope] = {f"{scope}.py::t": False}
    assert [queue.popitem(last=False)[0] for _ in range(2)] == ["b", "c"]
    queue["d"] = {}
    assert queue.popitem()[0] == "d"  # last=True: OrderedDict's own
    assert list(queue) == ["a"]


def test_durations_report_sums_setup_call_and_teardown_per_module() -> None:
    script = _load(ROOT / "scripts" / "test_durations.py", "test_durations_script")
    report = """
============================= slowest durations ==============================
40.10s setup    tests/test_train.py::test_a
2.50s call     tests/test_train.py::test_a
0.40s teardown tests/test_train.py::test_a
3.00s call     plugins/diffpipe_wan/tests/test_wan_train.py::test_b[1]
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
"""
    seconds = script.module_seconds(report)
    assert seconds == {"tests/test_train.py": 43.0, "plugins/diffpipe_wan/tests/test_wan_train.py": 3.0}


def test_the_committed_durations_name_existing_modules() -> None:
    import json

    measured = json.loads((ROOT / "tests" / "durations.json").read_text())
    missing = [m for m in measured if not (ROOT / m).exists()]
    assert not missing, f"tests/durations.json names modules that are gone: {missing} (scripts/test_durations.py)"
