"""Shared fixtures: HF libraries offline (the core's ``hf_offline``); one tiny model per Cosmos generation written to
disk per session (diffusers folder + original NVIDIA single file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.fixtures import hf_offline  # noqa: F401  (autouse)


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


@pytest.fixture(scope="session")
def predict2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``cosmos-predict2``: 2 pipeline stages over 2 processes, per stage from NVIDIA's single file, sampling as
    SAMPLE_TABLE says (a 5-frame video). Returns its run folder."""
    from test_cosmos_train import SAMPLE_TABLE, make_project

    from diffpipe_core.testing import runs

    root = tmp_path_factory.mktemp("predict2-run")
    return runs.train(root, make_project(root, "cosmos-predict2", 2, True, SAMPLE_TABLE), procs=2, timeout=600)


@pytest.fixture(scope="session")
def cosmos1_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``cosmos``: 1 stage in 1 process from the diffusers folder, on 2 CPU threads (the golden files were written by
    such a run: the float sums, and so the saved LoRA bytes, depend on the thread count). Returns its run folder."""
    from test_cosmos_train import make_project

    from diffpipe_core.testing import runs

    root = tmp_path_factory.mktemp("cosmos1-run")
    return runs.train(root, make_project(root, "cosmos", 1, False), procs=1, timeout=600, OMP_NUM_THREADS="2")


# Video-to-world ([model] conditioning = "video"): tiny video-to-world models and the shared runs on them
@pytest.fixture(scope="session")
def tiny_v2w(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny video-to-world folders (``CosmosVideoToWorldPipeline``, ``Cosmos2VideoToWorldPipeline``) by entry point."""
    from diffpipe_cosmos.testing import TinyCosmosConfig, write_tiny_cosmos

    root = tmp_path_factory.mktemp("v2w")
    return {
        name: write_tiny_cosmos(root / name, TinyCosmosConfig(variant=variant, video2world=True))
        for name, variant in (("cosmos", "1.0"), ("cosmos-predict2", "predict2"))
    }


@pytest.fixture(scope="session")
def predict2_v2w_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``cosmos-predict2`` video-to-world: 1 stage in 1 process, images and clips. Returns its run folder."""
    from test_cosmos_v2w_train import make_v2w_project

    from diffpipe_core.testing import runs

    root = tmp_path_factory.mktemp("predict2-v2w-run")
    return runs.train(root, make_v2w_project(root, "cosmos-predict2"), procs=1, timeout=600)


@pytest.fixture(scope="session")
def cosmos1_v2w_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``cosmos`` video-to-world: 1 stage in 1 process, images and clips. Returns its run folder."""
    from test_cosmos_v2w_train import make_v2w_project

    from diffpipe_core.testing import runs

    root = tmp_path_factory.mktemp("cosmos1-v2w-run")
    return runs.train(root, make_v2w_project(root, "cosmos"), procs=1, timeout=600)


@pytest.fixture(scope="session")
def tiny_predict25(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Cosmos-Predict2.5 folder (``Cosmos2_5_PredictBasePipeline``)."""
    from diffpipe_cosmos.testing_predict25 import write_tiny_predict25

    return write_tiny_predict25(tmp_path_factory.mktemp("predict25") / "tiny")


@pytest.fixture(scope="session")
def predict25_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``cosmos-predict2.5``: the shared 1-process run on images and clips. Returns its run folder."""
    from test_cosmos_predict25_train import STEPS, make_project

    from diffpipe_core.testing import runs

    root = tmp_path_factory.mktemp("predict25-run")
    return runs.train(root, make_project(root, stages=1, steps=STEPS), procs=1, timeout=600)


# Anima: the tiny modular-pipeline folder (and its ComfyUI file beside it)
@pytest.fixture(scope="session")
def tiny_anima(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ``AnimaModularPipeline`` folder; its ComfyUI file is ``diffpipe_cosmos.testing_anima.comfy_path``."""
    from diffpipe_cosmos.testing_anima import write_tiny_anima

    return write_tiny_anima(tmp_path_factory.mktemp("anima") / "AnimaModularPipeline")
