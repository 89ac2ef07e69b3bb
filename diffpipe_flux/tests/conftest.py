"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny Flux, Chroma, FLUX.2 [dev] and [klein],
FLUX.3 and its step-distilled flow map written to disk per session (diffusers folder + original single file); the
shared Flux 2-stage run and the shared Chroma, FLUX.2 and Klein runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline, tiny_model_fixture  # noqa: F401  (hf_offline: autouse)


@pytest.fixture(scope="session")
def flux_two_stages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared Flux run on 2 pipeline stages x 1 (diffusers folder layout, per-stage loading), sampling as
    test_flux_train.SAMPLE_TABLE says: test_flux_train's ``two_stages`` and test_flux_sampling's run. Returns its run
    folder."""
    from test_flux_train import SAMPLE_TABLE, make_project, train

    root = tmp_path_factory.mktemp("stages")
    config = make_project(root, stages=2, single_file=False)
    config.write_text(config.read_text() + SAMPLE_TABLE)
    return train(root, config)


@pytest.fixture(scope="session")
def chroma_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared Chroma run: 1 process from Chroma's original single file, sampling before the first and after the
    last step (test_chroma_train). Returns its run folder."""
    from test_chroma_train import make_project

    from diffpipe_core.testing import runs

    root = tmp_path_factory.mktemp("chroma_run")
    return runs.train(root, make_project(root), procs=1, timeout=400)


def _flux2_run(tmp_path_factory: pytest.TempPathFactory, variant: str, stages: int) -> Path:
    from test_flux2_train import make_project

    from diffpipe_core.testing import runs

    root = tmp_path_factory.mktemp(f"{variant}_run")
    return runs.train(root, make_project(root, variant, stages), procs=stages, timeout=400)


@pytest.fixture(scope="session")
def klein_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared FLUX.2 [klein] run: 1 process from the BFL / ComfyUI single file, sampling before the first and
    after the last step (test_flux2_train). Returns its run folder."""
    return _flux2_run(tmp_path_factory, "flux2-klein", 1)


@pytest.fixture(scope="session")
def flux2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared FLUX.2 [dev] run, as ``klein_run`` but on 2 pipeline stages in 2 processes (the two entry points
    share the layers, so the pair trains them on 1 and on 2 stages)."""
    return _flux2_run(tmp_path_factory, "flux2", 2)


# the tiny models, each written once per session
tiny_flux = tiny_model_fixture(
    "tiny_flux",
    "diffpipe_flux.testing:write_tiny_flux",
    "A tiny dev-like Flux folder; its BFL single file is ``diffpipe_flux.testing.bfl_path(folder)``.",
)
tiny_chroma = tiny_model_fixture(
    "tiny_chroma",
    "diffpipe_flux.testing:write_tiny_chroma",
    "A tiny Chroma folder; its original-layout single file is ``diffpipe_flux.testing.bfl_path(folder)``.",
)
tiny_klein = tiny_model_fixture(
    "tiny_klein",
    "diffpipe_flux.testing:write_tiny_klein",
    "A tiny FLUX.2 [klein] folder; its BFL / ComfyUI single file is ``diffpipe_flux.testing.bfl_path(folder)``.",
)
tiny_flux2 = tiny_model_fixture(
    "tiny_flux2",
    "diffpipe_flux.testing:write_tiny_flux2",
    "A tiny FLUX.2 [dev] folder; its BFL / ComfyUI single file is ``diffpipe_flux.testing.bfl_path(folder)``.",
)
tiny_flux3 = tiny_model_fixture(
    "tiny_flux3",
    "diffpipe_flux.testing_flux3:write_tiny_flux3",
    "A tiny FLUX.3 folder; its BFL single file is ``diffpipe_flux.testing_flux3.bfl_path(folder)``.",
)
tiny_flux3_distilled = tiny_model_fixture(
    "tiny_flux3_distilled",
    "diffpipe_flux.testing_flux3:write_tiny_flux3_distilled",
    "A tiny step-distilled FLUX.3 folder (a flow-map transformer); its BFL single file beside it.",
)
