"""Shared fixtures: HF libraries stay offline and write nothing outside the test's tmp dir; one tiny LTX-Video
written to disk per session (diffusers folder + original-layout single file)."""

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
def tiny_ltx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LTX-Video folder; its single file is ``diffpipe_ltx.testing.single_file_path(folder)``."""
    from diffpipe_ltx.testing import write_tiny_ltx

    return write_tiny_ltx(tmp_path_factory.mktemp("ltx") / "tiny-ltx")
