"""Scheduling for the suite's two pytest-xdist workers (``scripts/test.sh``: ``-n 2``).

Each worker builds its own session fixtures, so the tests that share one must run on the same worker, or a plugin's
shared tiny training run is trained twice. A module's tests stay together (its module fixtures are built once), and
modules that use the same session- or package-scoped conftest fixture join one group.

The workers compute the groups from their collection (the fixtures each test uses) and write them to a file the
controller's scheduler reads; xdist's own ``--dist loadgroup`` cannot be used, since it renames node ids in a way
pytest 9 no longer lets it. xdist hands out the groups with the most tests first. Without xdist none of this runs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_SHARED_SCOPES = ("session", "package")
_GROUPS_ENV = "DIFFPIPE_TEST_GROUPS"


def _find(parent: dict[str, str], key: str) -> str:
    while parent.setdefault(key, key) != key:
        parent[key] = parent[parent[key]]
        key = parent[key]
    return key


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def shared_fixture_groups(items: list[pytest.Item]) -> dict[str, str]:
    """Module path -> group name: the union of modules that share a session- or package-scoped fixture defined in a
    conftest (pytest's own and installed plugins' fixtures, such as ``tmp_path_factory``, join nothing)."""
    parent: dict[str, str] = {}
    for item in items:
        module = _find(parent, _module(item.nodeid))
        info = getattr(item, "_fixtureinfo", None)
        for name in info.names_closure if info else ():
            defs = info.name2fixturedefs.get(name)
            if not defs:
                continue
            fixturedef = defs[-1]
            baseid = fixturedef.baseid
            if fixturedef.scope in _SHARED_SCOPES and baseid and "::" not in baseid and not baseid.endswith(".py"):
                root = _find(parent, f"{baseid}/{name}")
                parent[_find(parent, module)] = root
    return {m: _find(parent, m) for m in {_module(item.nodeid) for item in items}}


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and _GROUPS_ENV not in os.environ:  # the controller
        folder = Path(tempfile.mkdtemp(prefix="diffpipe-test-groups-"))
        os.environ[_GROUPS_ENV] = str(folder / "groups.json")  # the workers inherit it


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    target = os.environ.get(_GROUPS_ENV)
    if not target or "PYTEST_XDIST_WORKER" not in os.environ:
        return
    tmp = Path(f"{target}.{os.environ['PYTEST_XDIST_WORKER']}")
    tmp.write_text(json.dumps(shared_fixture_groups(items)))
    os.replace(tmp, target)  # both workers write the same groups


def pytest_unconfigure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        target = os.environ.pop(_GROUPS_ENV, None)
        if target:
            shutil.rmtree(Path(target).parent, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: without xdist installed, nothing calls it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        """xdist's per-module scheduling (the largest scopes first), with modules joined into the workers' groups."""

        _groups: dict | None = None

        def _table(self) -> dict:
            if self._groups is None:
                self._groups = json.loads(Path(os.environ[_GROUPS_ENV]).read_text())
            return self._groups

        def _split_scope(self, nodeid: str) -> str:
            return self._table().get(_module(nodeid), _module(nodeid))

    return SharedFixtureScheduling(config, log)
