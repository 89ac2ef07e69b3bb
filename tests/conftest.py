"""Shared test fixtures: HF libraries stay offline and write nothing outside the test's tmp dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read by datasets at import time


@pytest.fixture(autouse=True)
def _hf_offline(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.getbasetemp() / "hf_home"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def reference_two_stages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared uninterrupted reference run on 2 pipeline stages (12 steps, a checkpoint every 3): test_train's
    ``two_stages``, and the sampling-off baseline of test_sampling. Returns its run folder."""
    from test_train import make_project, run_dirs, train

    root = tmp_path_factory.mktemp("two_stages")
    config = make_project(root, stages=2, max_steps=12, ckpt=3)
    train(root, config, "--num-procs", "2")
    return run_dirs(root)[0]
