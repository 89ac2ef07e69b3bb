"""pytest fixtures every plugin's tests use; import them into the plugin's ``conftest.py``::

    from diffpipe_core.testing.fixtures import hf_offline  # noqa: F401  (autouse)

``hf_offline`` keeps the HF libraries offline and writing only inside the session's tmp folder (their caches
included), for every test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

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
