"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny LTX-Video written to disk per session
(diffusers folder + original-layout single file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline  # noqa: F401  (autouse)


@pytest.fixture(scope="session")
def tiny_ltx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LTX-Video folder; its single file is ``diffpipe_ltx.testing.single_file_path(folder)``."""
    from diffpipe_ltx.testing import write_tiny_ltx

    return write_tiny_ltx(tmp_path_factory.mktemp("ltx") / "tiny-ltx")


@pytest.fixture(scope="session")
def tiny_ltx2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LTX-2 folder (``LTX2Pipeline``); its single file is ``diffpipe_ltx.ltx2_testing.single_file_path``."""
    from diffpipe_ltx.ltx2_testing import write_tiny_ltx2

    return write_tiny_ltx2(tmp_path_factory.mktemp("ltx2") / "tiny-ltx2")


@pytest.fixture(scope="session")
def ltx2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared LTX-2 run: 1 process from the diffusers folder on clips and images (first-frame conditioning
    p = 0.5), sampling after the last step (test_ltx2_train, test_ltx2_sampling). Returns its run folder."""
    from test_ltx2_train import make_project

    from diffpipe_core.testing import runs

    root = tmp_path_factory.mktemp("ltx2_run")
    return runs.train(root, make_project(root), procs=1, timeout=500)
