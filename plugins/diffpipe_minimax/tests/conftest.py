"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny MiniMax H3 folder per session; the
shared training run (1 process, video and audio) and the shared audio-only run (2 pipeline stages)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline, tiny_model_fixture  # noqa: F401  (hf_offline: autouse)


@pytest.fixture(scope="session")
def minimax_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one shared MiniMax H3 training run (``test_minimax_train.make_project``: 1 process, the modular folder
    with its transformer as a pruned (curve-form) file, tone clips and images, ``train_audio`` and CFG-augmented
    training); serves every 1-process run assertion."""
    from test_minimax_train import make_project

    from diffpipe_core.testing import runs

    root = make_project(tmp_path_factory.mktemp("minimax-train"))
    return runs.train(root, "run.toml", 1, OMP_NUM_THREADS="1")


@pytest.fixture(scope="session")
def minimax_audio_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared audio-only MiniMax H3 run (``test_minimax_audio.audio_run``: ``train_video = false``, 2 processes,
    2 pipeline stages, the core's tone clips and images); serves every 2-stage assertion."""
    from test_minimax_audio import audio_run

    return audio_run(tmp_path_factory.mktemp("minimax-audio"))


tiny_minimax = tiny_model_fixture(
    "tiny_minimax", "diffpipe_minimax.testing:write_tiny_minimax", "A tiny MiniMax H3 modular pipeline folder."
)
