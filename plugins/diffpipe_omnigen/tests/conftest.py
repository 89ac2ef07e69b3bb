"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny OmniGen2 written to disk per session
(the released folder layout + a ComfyUI-style transformer file); the one shared training run."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline, tiny_model_fixture  # noqa: F401  (hf_offline: autouse)


@pytest.fixture(scope="session")
def omnigen_run(tmp_path_factory: pytest.TempPathFactory, tiny_omnigen2: Path) -> Path:
    """The one shared OmniGen2 training run (``test_omnigen_train.make_project``: 2 pipeline stages in 2 processes,
    the folder, 4 captioned 32x32 images); serves every run assertion. Returns its run folder."""
    from test_omnigen_train import make_project

    from diffpipe_core.testing import runs

    root = make_project(tmp_path_factory.mktemp("omnigen-train"), tiny_omnigen2)
    return runs.train(root, "run.toml", 2, timeout=600, OMP_NUM_THREADS="1")


# the tiny model, written once per session
tiny_omnigen2 = tiny_model_fixture(
    "tiny_omnigen2",
    "diffpipe_omnigen.testing:write_tiny_omnigen2",
    "A tiny OmniGen2 folder; its ComfyUI-style transformer file is ``diffpipe_omnigen.testing.comfy_path(folder)``.",
)
