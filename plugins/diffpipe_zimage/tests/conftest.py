"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny Z-Image written to disk per session
(diffusers folder + original-layout single file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline, tiny_model_fixture  # noqa: F401  (hf_offline: autouse)


@pytest.fixture(scope="session")
def zimage_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one shared Z-Image training run (``test_zimage_train.make_project``: 1 process, the diffusers folder, 4
    captioned 32x32 images); serves every run assertion. Returns its run folder."""
    from test_zimage_train import make_project

    from diffpipe_core.testing import runs

    root = make_project(tmp_path_factory.mktemp("zimage-train"))
    return runs.train(root, "run.toml", 1, OMP_NUM_THREADS="1")


# the tiny models, each written once per session
tiny_zimage = tiny_model_fixture(
    "tiny_zimage",
    "diffpipe_zimage.testing:write_tiny_zimage",
    "A tiny Z-Image folder; its original-layout file is ``diffpipe_zimage.testing.original_path(folder)``.",
)
