"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny HiDream written to disk per session
(diffusers folder + ComfyUI single file); the one shared training run."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline, tiny_model_fixture  # noqa: F401  (hf_offline: autouse)


@pytest.fixture(scope="session")
def hidream_run(tmp_path_factory: pytest.TempPathFactory, tiny_hidream: Path) -> Path:
    """The one shared HiDream training run (``test_hidream_train.make_project``: 1 process, the diffusers folder, 4
    captioned 32x32 images); serves every run assertion. Returns its run folder."""
    from test_hidream_train import make_project

    from diffpipe_core.testing import runs

    root = make_project(tmp_path_factory.mktemp("hidream-train"), tiny_hidream)
    return runs.train(root, "run.toml", 1, OMP_NUM_THREADS="1")


# the tiny model, written once per session
tiny_hidream = tiny_model_fixture(
    "tiny_hidream",
    "diffpipe_hidream.testing:write_tiny_hidream",
    "A tiny HiDream-I1 folder; its ComfyUI file is ``diffpipe_hidream.testing.comfy_path(folder)``.",
)
