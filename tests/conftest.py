"""Shared test fixtures: HF libraries stay offline and write nothing outside the test's tmp dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline  # noqa: F401  (autouse; sets HF_DATASETS_OFFLINE at import)


@pytest.fixture(scope="session")
def reference_two_stages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared uninterrupted reference run on 2 pipeline stages (12 steps, a checkpoint every 3): test_train's
    ``two_stages``, and the sampling-off baseline of test_sampling. Returns its run folder."""
    from test_train import make_project, run_dirs, train

    root = tmp_path_factory.mktemp("two_stages")
    config = make_project(root, stages=2, max_steps=12, ckpt=3)
    train(root, config, "--num-procs", "2")
    return run_dirs(root)[0]
