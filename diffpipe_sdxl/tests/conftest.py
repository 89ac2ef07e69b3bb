"""Shared test fixtures: HF libraries stay offline and write nothing outside the test's tmp dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read by datasets at import time
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # session fixtures run before the per-test monkeypatch


@pytest.fixture(autouse=True)
def _hf_offline(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.getbasetemp() / "hf_home"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_sdxl(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny SDXL as a diffusers folder and as an original-layout single file (same weights)."""
    from diffpipe_sdxl.testing import write_single_file, write_tiny_sdxl

    root = tmp_path_factory.mktemp("tiny_sdxl")
    folder = write_tiny_sdxl(root / "model")
    return folder, write_single_file(folder, root / "sdxl_tiny.safetensors")
