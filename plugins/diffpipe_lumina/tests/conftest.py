"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny Lumina 2 written to disk per session
(diffusers folder + original-layout single file); the one shared training run."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline, tiny_model_fixture  # noqa: F401  (hf_offline: autouse)


@pytest.fixture(scope="session")
def lumina_run(tmp_path_factory: pytest.TempPathFactory, tiny_lumina2: Path) -> Path:
    """The one shared Lumina 2 training run (``test_lumina_train.make_project``: 1 process, the diffusers folder, 4
    captioned 32x32 images); serves every run assertion. Returns its run folder."""
    from test_lumina_train import make_project

    from diffpipe_core.testing import runs

    root = make_project(tmp_path_factory.mktemp("lumina-train"), tiny_lumina2)
    return runs.train(root, "run.toml", 1, OMP_NUM_THREADS="1")


# the tiny model, written once per session
tiny_lumina2 = tiny_model_fixture(
    "tiny_lumina2",
    "diffpipe_lumina.testing:write_tiny_lumina2",
    "A tiny Lumina 2 folder; its original-layout file is ``diffpipe_lumina.testing.original_path(folder)``.",
)
