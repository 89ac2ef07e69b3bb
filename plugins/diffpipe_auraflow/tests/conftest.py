"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny AuraFlow written to disk per session
(diffusers folder + original-layout single file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline, tiny_model_fixture  # noqa: F401  (hf_offline: autouse)


@pytest.fixture(scope="session")
def auraflow_run(tmp_path_factory: pytest.TempPathFactory, tiny_auraflow: Path) -> Path:
    """The one shared AuraFlow training run (``test_auraflow_train.make_project``: 1 process, the diffusers folder, 4
    captioned 32x32 images); serves every run assertion. Returns its run folder."""
    from test_auraflow_train import make_project

    from diffpipe_core.testing import runs

    root = make_project(tmp_path_factory.mktemp("auraflow-train"), tiny_auraflow)
    return runs.train(root, "run.toml", 1, OMP_NUM_THREADS="1")


# the tiny model, written once per session
tiny_auraflow = tiny_model_fixture(
    "tiny_auraflow",
    "diffpipe_auraflow.testing:write_tiny_auraflow",
    "A tiny AuraFlow folder; its original-layout file is ``diffpipe_auraflow.testing.original_path(folder)``.",
)
