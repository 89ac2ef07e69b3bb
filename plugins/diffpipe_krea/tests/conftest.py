"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny Krea 2 folder per session (diffusers
folder + original-layout single file beside it) and its Turbo copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline  # noqa: F401  (autouse)


@pytest.fixture(scope="session")
def tiny_krea2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ``Krea2Pipeline`` folder; its original-layout file is ``diffpipe_krea.testing.comfy_path(folder)``."""
    from diffpipe_krea.testing import write_tiny_krea2

    return write_tiny_krea2(tmp_path_factory.mktemp("krea2") / "Krea2Pipeline")


@pytest.fixture(scope="session")
def tiny_krea2_turbo(tiny_krea2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Krea 2 Turbo folder: ``tiny_krea2``'s weights with ``is_distilled`` in its ``model_index.json``."""
    from diffpipe_krea.testing import as_turbo

    return as_turbo(tiny_krea2, tmp_path_factory.mktemp("krea2") / "turbo")
