"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny SD3 written to disk per session
(diffusers folder + Stability-layout single file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline, tiny_model_fixture  # noqa: F401  (hf_offline: autouse)


@pytest.fixture(scope="session")
def sd3_run(tmp_path_factory: pytest.TempPathFactory, tiny_sd3: Path) -> Path:
    """The one shared SD3 training run (``test_sd3_train.make_project``: 1 process, the diffusers folder, 4
    captioned 32x32 images); serves every run assertion. Returns its run folder."""
    from test_sd3_train import make_project

    from diffpipe_core.testing import runs

    root = make_project(tmp_path_factory.mktemp("sd3-train"), tiny_sd3)
    return runs.train(root, "run.toml", 1, OMP_NUM_THREADS="1")


# the tiny model, written once per session
tiny_sd3 = tiny_model_fixture(
    "tiny_sd3",
    "diffpipe_sd3.testing:write_tiny_sd3",
    "A tiny SD3 folder; its Stability-layout file is ``diffpipe_sd3.testing.original_path(folder)``.",
)
