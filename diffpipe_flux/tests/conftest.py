"""Shared fixtures: HF libraries stay offline and write nothing outside the test's tmp dir; one tiny Flux
written to disk per session (diffusers folder + BFL single file)."""

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
def tiny_flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny dev-like Flux folder; its BFL single file is ``diffpipe_flux.testing.bfl_path(folder)``."""
    from diffpipe_flux.testing import write_tiny_flux

    return write_tiny_flux(tmp_path_factory.mktemp("flux") / "tiny-flux")
