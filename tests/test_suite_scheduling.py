"""The suite's own scheduling (the repository's ``conftest.py``): measured durations per module, and the queue that
hands xdist the longest group first."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_a_partial_report_merges_in_scaled_by_its_calibration_modules(tmp_path: Path) -> None:
    """A busy machine's report of a few modules: the calibration modules keep their committed seconds and scale the
    others (here twice as slow); a module pytest named by a shortened path is found by its file name."""
    script = _load(ROOT / "scripts" / "test_durations.py", "test_durations_script")
    (tmp_path / "plugins/diffpipe_x/tests").mkdir(parents=True)
    (tmp_path / "plugins/diffpipe_x/tests/test_x_train.py").write_text("")
    assert script.resolve("tests/test_x_train.py", tmp_path) == "plugins/diffpipe_x/tests/test_x_train.py"
    committed = {"tests/test_cache.py": 20.0, "tests/test_old.py": 5.0, "tests/test_krea.py": 10.0}
    measured = {"tests/test_cache.py": 41.0, "tests/test_krea.py": 19.0,
                "tests/test_new.py": 8.0, "tests/test_old.py": 3.0}  # fmt: skip
    merged = script.merged(committed, measured, ["tests/test_cache.py", "tests/test_krea.py"])
    assert merged == {"tests/test_cache.py": 20.0, "tests/test_krea.py": 10.0, "tests/test_new.py": 4.0,
                      "tests/test_old.py": 1.5}  # fmt: skip
    assert list(merged) == ["tests/test_cache.py", "tests/test_krea.py", "tests/test_new.py", "tests/test_old.py"]
    with pytest.raises(SystemExit, match="calibration modules must be both committed and in the report"):
        script.merged(committed, measured, ["tests/test_new.py"])


def test_the_committed_durations_name_existing_modules() -> None:
    import json

    measured = json.loads((ROOT / "tests" / "durations.json").read_text())
    missing = [m for m in measured if not (ROOT / m).exists()]
    assert not missing, f"tests/durations.json names modules that are gone: {missing} (scripts/test_durations.py)"


def test_the_last_line_names_the_skipped_tests(tmp_path: Path) -> None:
    """conftest.py ends a run with one line naming each skipped test (not an expected failure) and its reason,
    once under xdist (the controller's copy of a worker's report): a test that cannot run in CI is seen."""
    (tmp_path / "test_some.py").write_text(
        "import pytest\n\n"
        "def test_runs():\n    assert True\n\n"
        "def test_cannot_here():\n    pytest.skip('cannot mount a tmpfs here\\nsecond line')\n\n"
        "@pytest.mark.xfail(reason='known')\ndef test_known():\n    raise ValueError\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DIFFPIPE_TEST_"))}
    env["PYTHONPATH"] = str(ROOT)  # the repository's conftest.py, as a plugin of a run in another folder
    for workers in (["-n", "2"], ["-p", "no:xdist"]):
        command = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", *workers,
                   "test_some.py"]
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        lines = result.stdout.strip().splitlines()
        assert lines[-1] == "skipped (1): test_some.py::test_cannot_here (cannot mount a tmpfs here)", lines[-3:]
        assert "1 passed, 1 skipped, 1 xfailed" in lines[-2]


def test_the_proof_twins_run_once_when_the_proof_dry_run_runs_them() -> None:
    """The CPU twins of test_cuda_proof.py are left to the GPU proof's dry run when it is collected (it runs them and
    fails unless all pass); without it, or with only the cuda cases, nothing is left out."""
    import pytest

    chosen = _load(ROOT / "conftest.py", "suite_conftest").run_by_the_proof_dry_run

    class Item:
        def __init__(self, nodeid: str, cuda: bool = False) -> None:
            self.nodeid, self.cuda = nodeid, cuda

        def get_closest_marker(self, name: str) -> object:
            return pytest.mark.cuda if name == "cuda" and self.cuda else None

    dry = Item("tests/test_gpu_proof.py::test_cpu_dry_run_writes_the_keys_the_gpu_run_writes")
    twin = Item("tests/test_cuda_proof.py::test_kahan[cpu]")
    cuda = Item("tests/test_cuda_proof.py::test_kahan[cuda]", cuda=True)
    other = Item("tests/test_train.py::test_a")
    assert chosen([twin, cuda, dry, other]) == [twin]
    assert chosen([twin, cuda, other]) == []


def test_modules_sharing_a_session_fixture_run_on_one_worker_and_autouse_ones_join_nothing(tmp_path: Path) -> None:
    """Two modules using one conftest session fixture, and a third asking for it by name at run time
    (``request.getfixturevalue``), are one unit of work (the fixture is built once); an autouse session fixture
    (``hf_offline`` in every conftest here) does not join the modules under it, or every package would be one unit:
    the fourth module goes to the other worker."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "conftest.py").write_text(
        "import os\nimport pytest\n\n"
        "@pytest.fixture(autouse=True, scope='session')\ndef everywhere():\n    yield\n\n"
        "@pytest.fixture(scope='session')\ndef shared():\n    return os.getpid()\n"
    )
    for name, uses in (("a", "shared"), ("b", "shared"), ("c", "")):
        tests = "".join(f"def test_{name}{i}({uses}):\n    assert True\n\n" for i in range(3))
        (tmp_path / "pkg" / f"test_{name}.py").write_text(tests)
    (tmp_path / "pkg" / "test_d.py").write_text(
        "import pytest\n\nWHICH = {'x': 'shared'}\n\n@pytest.fixture(params=['x'])\ndef value(request):\n"
        "    return request.getfixturevalue(WHICH[request.param])\n\ndef test_d(value):\n    assert value\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DIFFPIPE_TEST_"))}
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "-m", "pytest", "-v", "-p", "conftest", "-p", "no:cacheprovider", "-n", "2",
               "--import-mode=importlib", "pkg"]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    workers: dict[str, set[str]] = {}
    for line in result.stdout.splitlines():
        if line.startswith("[gw") and "PASSED" in line:
            workers.setdefault(line.split("::")[0].rsplit("/", 1)[-1], set()).add(line.split("]")[0])
    assert set(workers) == {"test_a.py", "test_b.py", "test_c.py", "test_d.py"}, result.stdout
    assert all(len(w) == 1 for w in workers.values()), workers
    assert workers["test_a.py"] == workers["test_b.py"] == workers["test_d.py"] != workers["test_c.py"], workers
