"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny SDXL written to disk per session, as a
diffusers folder and as an original-layout single file (same weights)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline  # noqa: F401  (autouse)


@pytest.fixture(scope="session")
def tiny_sdxl(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny SDXL as a diffusers folder and as an original-layout single file (same weights)."""
    from diffpipe_sdxl.testing import write_single_file, write_tiny_sdxl

    root = tmp_path_factory.mktemp("tiny_sdxl")
    folder = write_tiny_sdxl(root / "model")
    return folder, write_single_file(folder, root / "sdxl_tiny.safetensors")


@pytest.fixture(scope="session")
def sdxl_two_stages(tiny_sdxl: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The golden SDXL run: a LoRA on 2 pipeline stages from the single-file checkpoint, sampling as SAMPLE_TABLE
    says (test_sdxl_train's ``two_stages``, test_sdxl_sampling's run). Returns its run folder."""
    from test_sdxl_train import SAMPLE_TABLE, make_project

    from diffpipe_core.testing.runs import train

    root = tmp_path_factory.mktemp("two_stages")
    project = make_project(root, tiny_sdxl, stages=2, steps=4, single_file=True, lora=True, tables=SAMPLE_TABLE)
    return train(root, project, procs=2, timeout=400)
