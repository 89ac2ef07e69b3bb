"""Scheduling for the suite's two pytest-xdist workers (``scripts/test.sh``: ``-n 2``).

Each worker builds its own session fixtures, so the tests that share one must run on the same worker, or a plugin's
shared tiny training run is trained twice. A module's tests stay together (its module fixtures are built once), and
modules that use the same session- or package-scoped conftest fixture (or name it for ``request.getfixturevalue``)
join one group; autouse fixtures join nothing.

The workers compute the groups from their collection (the fixtures each test uses) and write them to a file the
controller's scheduler reads; xdist's own ``--dist loadgroup`` cannot be used, since it renames node ids in a way
pytest 9 no longer lets it. The scheduler hands out the groups that took longest in a measured run first
(``tests/durations.json``, written by ``scripts/test_durations.py`` from a ``--durations=0`` report; a module not in
it, usually a new one with a shared run, counts as a long one): longest-first keeps both workers busy to the end
instead of leaving one to finish a long group alone. Without xdist none of this runs.

The last line of a run names the skipped tests, if any, so a test that cannot run in CI is seen.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pytest

_SHARED_SCOPES = ("session", "package")
_GROUPS_ENV = "DIFFPIPE_TEST_GROUPS"
_DURATIONS = Path(__file__).parent / "tests" / "durations.json"
_UNMEASURED_SECONDS = 30.0  # a new module often holds a shared run: started early, it cannot leave a long tail


def _find(parent: dict[str, str], key: str) -> str:
    while parent.setdefault(key, key) != key:
        parent[key] = parent[parent[key]]
        key = parent[key]
    return key


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _shared(fixturedef: object) -> bool:
    """A session- or package-scoped fixture of a conftest (not pytest's or a plugin's, not a module's), not autouse:
    every worker builds an autouse one for its first test under it wherever the modules run, so it shares nothing."""
    baseid = getattr(fixturedef, "baseid", "")
    return (
        getattr(fixturedef, "scope", None) in _SHARED_SCOPES
        and not getattr(fixturedef, "_autouse", False)
        and bool(baseid)
        and "::" not in baseid
        and not baseid.endswith(".py")
    )


def _requested_by_name(item: pytest.Item, source: str) -> set[str]:
    """The shared conftest fixtures a module may ask for at run time (``request.getfixturevalue(name)``), which its
    tests' fixture closures do not show: those visible to it whose name is in its source (``"klein_run"`` in a
    table of variants), with the shared fixtures they depend on."""
    if "getfixturevalue" not in source:
        return set()
    manager = getattr(item.session, "_fixturemanager", None)
    names = {*getattr(manager, "_arg2node2fixturedefs", {}), *getattr(manager, "_arg2nodeid2fixturedefs", {})}

    def visible(name: str) -> object | None:
        defs = manager.getfixturedefs(name, item) if manager is not None else None  # the most specific last
        return defs[-1] if defs and _shared(defs[-1]) else None

    found: set[str] = set()
    todo = [n for n in names if re.search(rf"\b{re.escape(n)}\b", source) and visible(n) is not None]
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo += [a for a in visible(name).argnames if visible(a) is not None]  # type: ignore[union-attr]
    return {f"{visible(n).baseid}/{n}" for n in found}  # type: ignore[union-attr]


def shared_fixture_groups(items: list[pytest.Item]) -> dict[str, str]:
    """Module path -> group name: the union of modules that share a session- or package-scoped fixture defined in a
    conftest, used by their tests or asked for by name at run time (:func:`_requested_by_name`). pytest's own and
    installed plugins' fixtures, such as ``tmp_path_factory``, join nothing, and neither do autouse ones such as
    ``hf_offline`` (:func:`_shared`): joining by those made each package's tests one group, the core's alone 45% of
    the suite."""
    parent: dict[str, str] = {}
    scanned: set[str] = set()
    for item in items:
        module = _module(item.nodeid)
        _find(parent, module)
        info = getattr(item, "_fixtureinfo", None)
        keys = set()
        for name in info.names_closure if info else ():
            defs = info.name2fixturedefs.get(name)
            if defs and _shared(defs[-1]):
                keys.add(f"{defs[-1].baseid}/{name}")
        if module not in scanned:
            scanned.add(module)
            path = getattr(item, "path", None)
            if path is not None and path.suffix == ".py" and path.is_file():
                keys |= _requested_by_name(item, path.read_text(errors="replace"))
        for key in keys:
            parent[_find(parent, module)] = _find(parent, key)
    return {m: _find(parent, m) for m in {_module(item.nodeid) for item in items}}


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and _GROUPS_ENV not in os.environ:  # the controller
        folder = Path(tempfile.mkdtemp(prefix="diffpipe-test-groups-"))
        os.environ[_GROUPS_ENV] = str(folder / "groups.json")  # the workers inherit it


_PROOF_DRY_RUN = "tests/test_gpu_proof.py::test_cpu_dry_run_writes_the_keys_the_gpu_run_writes"
_PROOF_TESTS = "tests/test_cuda_proof.py::"


def run_by_the_proof_dry_run(items: list[pytest.Item]) -> list[pytest.Item]:
    """The CPU twins of ``tests/test_cuda_proof.py`` when the GPU proof's CPU dry run is collected too: the dry run
    runs every one of them (``bench/gpu_proof.sh`` step 2, the same tests in the same checkout) and fails naming them
    unless all pass, so one run of the suite runs them once, not twice. Their ``cuda`` cases stay (they skip
    without a GPU, and are named so)."""
    if not any(item.nodeid == _PROOF_DRY_RUN for item in items):
        return []
    return [i for i in items if i.nodeid.startswith(_PROOF_TESTS) and i.get_closest_marker("cuda") is None]


@pytest.hookimpl(trylast=True)  # after -m and -k deselected theirs: a dry run left out leaves the twins in
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    twins = run_by_the_proof_dry_run(items)
    if twins:
        config.hook.pytest_deselected(items=twins)
        items[:] = [item for item in items if item not in twins]
    target = os.environ.get(_GROUPS_ENV)
    if not target or "PYTEST_XDIST_WORKER" not in os.environ:
        return
    tmp = Path(f"{target}.{os.environ['PYTEST_XDIST_WORKER']}")
    tmp.write_text(json.dumps(shared_fixture_groups(items)))
    os.replace(tmp, target)  # both workers write the same groups


_skipped: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Note each skipped test (not an expected failure) with its reason; under xdist the controller's copy of a
    worker's report counts."""
    if report.skipped and not hasattr(report, "wasxfail") and "PYTEST_XDIST_WORKER" not in os.environ:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr or "")
        reason = reason.removeprefix("Skipped: ").strip().splitlines()[0][:200] if reason.strip() else "no reason"
        _skipped.append(f"{report.nodeid} ({reason})")


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: after the terminal's summary and its counts line
def pytest_sessionfinish(session: pytest.Session) -> object:
    """Name the skipped tests on the very last line, so a test that cannot run where the suite ran (CI) is seen."""
    result = yield
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if _skipped and reporter is not None and "PYTEST_XDIST_WORKER" not in os.environ:
        reporter.write_line(f"skipped ({len(_skipped)}): " + "; ".join(sorted(_skipped)), yellow=True)
    return result


def pytest_unconfigure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        target = os.environ.pop(_GROUPS_ENV, None)
        if target:
            shutil.rmtree(Path(target).parent, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: without xdist installed, nothing calls it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        """xdist's per-module scheduling, with modules joined into the workers' groups, the longest group first."""

        _groups: dict | None = None

        def __init__(self, config: pytest.Config, log: object = None) -> None:
            super().__init__(config, log)
            self.workqueue = LongestFirst(self._seconds)

        def _table(self) -> dict:
            if self._groups is None:
                self._groups = json.loads(Path(os.environ[_GROUPS_ENV]).read_text())
            return self._groups

        def _split_scope(self, nodeid: str) -> str:
            return self._table().get(_module(nodeid), _module(nodeid))

        _group_seconds: dict[str, float] | None = None

        def _seconds(self, scope: str) -> float:
            if self._group_seconds is None:
                measured = json.loads(_DURATIONS.read_text()) if _DURATIONS.exists() else {}
                self._group_seconds = {}
                for module, group in self._table().items():
                    seconds = measured.get(module, _UNMEASURED_SECONDS)
                    self._group_seconds[group] = self._group_seconds.get(group, 0.0) + seconds
            return self._group_seconds.get(scope, _UNMEASURED_SECONDS)

    return SharedFixtureScheduling(config, log)


class LongestFirst(OrderedDict):
    """xdist's queue of work units (scope -> tests), handing out the unit ``seconds(scope)`` rates longest first
    (xdist takes the next unit with ``popitem(last=False)``)."""

    def __init__(self, seconds: Callable[[str], float]) -> None:
        super().__init__()
        self.seconds = seconds

    def popitem(self, last: bool = True) -> tuple[str, dict]:
        if last or not self:
            return super().popitem(last)
        scope = max(self, key=self.seconds)
        return scope, self.pop(scope)
