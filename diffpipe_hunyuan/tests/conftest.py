"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny HunyuanVideo written to disk per
session (diffusers folder + original-layout single file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline  # noqa: F401  (autouse)


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
