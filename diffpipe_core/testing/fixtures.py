"""pytest fixtures every plugin's tests use; import them into the plugin's ``conftest.py``::

    from diffpipe_core.testing.fixtures import hf_offline  # noqa: F401  (autouse)

``hf_offline`` keeps the HF libraries offline and writing only inside the session's tmp folder (their caches
included), for every test. :func:`tiny_model_fixture` makes the session fixture of a plugin's tiny model folder::

    tiny_ltx = tiny_model_fixture("tiny_ltx", "diffpipe_ltx.testing:write_tiny_ltx", "A tiny LTX-Video folder.")
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read by datasets at import time
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True, scope="session")
def hf_offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No hub access, and the HF caches under the session's tmp folder: set once for the session, so the shared
    runs that session- and module-scoped fixtures start see the environment the tests see."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HOME", str(tmp_path_factory.getbasetemp() / "hf_home"))
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


def tiny_model_fixture(name: str, writer: str, doc: str) -> Any:
    """A session fixture called ``name`` (``tiny_<model>``): the tiny model that ``writer`` (``"module:function"``,
    imported when the fixture first runs, called with the folder) writes once per session to
    ``<session tmp>/<name>N/<name with '-'>``; its value is the folder. ``doc`` is the fixture's docstring."""
    module, function = writer.split(":")

    def write(tmp_path_factory: pytest.TempPathFactory) -> Path:
        folder = tmp_path_factory.mktemp(name) / name.replace("_", "-")
        return getattr(importlib.import_module(module), function)(folder)

    write.__doc__ = doc
    return pytest.fixture(scope="session", name=name)(write)
