"""Shared fixtures: HF libraries stay offline and write nothing outside the test's tmp dir; one tiny
HunyuanVideo written to disk per session (diffusers folder + original-layout single file)."""

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
def tiny_hunyuan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HunyuanVideo folder; its original-layout file is ``diffpipe_hunyuan.testing.original_path(folder)``."""
    from diffpipe_hunyuan.testing import write_tiny_hunyuan

    return write_tiny_hunyuan(tmp_path_factory.mktemp("hunyuan") / "tiny-hunyuan")


@pytest.fixture(scope="session")
def crop_start() -> int:
    """``text_crop_start`` for the tiny model's Llama tokenizer."""
    from diffpipe_hunyuan.testing import llama_tokenizer, template_crop_start

    return template_crop_start(llama_tokenizer())
