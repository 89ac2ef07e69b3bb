"""Shared fixtures: HF libraries stay offline and write nothing outside the test's tmp dir; one tiny model per
Cosmos generation written to disk per session (diffusers folder + original NVIDIA single file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read by datasets at import time
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _hf_offline(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.getbasetemp() / "hf_home"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_cosmos1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Cosmos-1.0 folder; its original file is ``diffpipe_cosmos.testing.original_path(folder)``."""
    from diffpipe_cosmos.testing import TinyCosmosConfig, write_tiny_cosmos

    return write_tiny_cosmos(tmp_path_factory.mktemp("cosmos1") / "tiny", TinyCosmosConfig(variant="1.0"))


@pytest.fixture(scope="session")
def tiny_predict2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Cosmos-Predict2 folder; its original file is ``diffpipe_cosmos.testing.original_path(folder)``."""
    from diffpipe_cosmos.testing import TinyCosmosConfig, write_tiny_cosmos

    return write_tiny_cosmos(tmp_path_factory.mktemp("predict2") / "tiny", TinyCosmosConfig(variant="predict2"))


@pytest.fixture(scope="session")
def tiny_models(tiny_cosmos1: Path, tiny_predict2: Path) -> dict[str, Path]:
    """Model folder by entry-point name."""
    return {"cosmos": tiny_cosmos1, "cosmos-predict2": tiny_predict2}
