"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny model folder per pipeline class per
session (diffusers folder + ComfyUI-layout single file beside it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline  # noqa: F401  (autouse)


def _folder(factory: pytest.TempPathFactory, pipeline: str) -> Path:
    from diffpipe_qwenimage.testing import write_tiny_qwen

    return write_tiny_qwen(factory.mktemp("qwen") / pipeline, pipeline)


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ``QwenImagePipeline`` folder; its ComfyUI file is ``diffpipe_qwenimage.testing.comfy_path(folder)``."""
    return _folder(tmp_path_factory, "QwenImagePipeline")


@pytest.fixture(scope="session")
def tiny_edit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ``QwenImageEditPipeline`` (Qwen-Image-Edit: one reference image) folder."""
    return _folder(tmp_path_factory, "QwenImageEditPipeline")


@pytest.fixture(scope="session")
def tiny_edit_plus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ``QwenImageEditPlusPipeline`` (Qwen-Image-Edit-2509: several reference images) folder."""
    return _folder(tmp_path_factory, "QwenImageEditPlusPipeline")



@pytest.fixture(scope="session")
def tiny_qwen21(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ``QwenImage21Pipeline`` folder; its ComfyUI file is ``testing21.comfy_path(folder)``."""
    from diffpipe_qwenimage.testing21 import write_tiny_qwen21

    return write_tiny_qwen21(tmp_path_factory.mktemp("qwen21") / "QwenImage21Pipeline")


@pytest.fixture(scope="session")
def tiny_qwen21_turbo(tiny_qwen21: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen-Image 2.1 Turbo folder: ``tiny_qwen21``'s weights with ``sample_sigmas`` in its
    ``model_index.json``, as the Turbo checkpoint's config carries its grid."""
    from diffpipe_qwenimage.testing21 import as_turbo

    return as_turbo(tiny_qwen21, tmp_path_factory.mktemp("qwen21") / "turbo")
