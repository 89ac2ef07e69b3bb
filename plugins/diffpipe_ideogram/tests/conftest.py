"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny Ideogram 4 folder per session (diffusers
folder + original-layout single file beside it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline  # noqa: F401  (autouse)


@pytest.fixture(scope="session")
def tiny_ideogram4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ``Ideogram4Pipeline`` folder; its original-layout file is ``diffpipe_ideogram.testing.comfy_path``."""
    from diffpipe_ideogram.testing import write_tiny_ideogram4

    return write_tiny_ideogram4(tmp_path_factory.mktemp("ideogram4") / "Ideogram4Pipeline")
