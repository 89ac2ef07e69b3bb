"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny ERNIE-Image written to disk per session
(diffusers folder + ComfyUI's single file); the one shared training run."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline, tiny_model_fixture  # noqa: F401  (hf_offline: autouse)


@pytest.fixture(scope="session")
def ernie_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one shared ERNIE-Image training run (``test_ernie_train.make_project``: 1 process, the diffusers folder,
    4 captioned 32x32 images); serves every run assertion. Returns its run folder."""
    from test_ernie_train import make_project

    from diffpipe_core.testing import runs

    root = make_project(tmp_path_factory.mktemp("ernie-train"))
    return runs.train(root, "run.toml", 1, OMP_NUM_THREADS="1")


tiny_ernie = tiny_model_fixture(
    "tiny_ernie",
    "diffpipe_ernie.testing:write_tiny_ernie",
    "A tiny ERNIE-Image folder; ComfyUI's single file is ``diffpipe_ernie.testing.comfy_path(folder)``.",
)
