"""AuraFlow's 2-stage training: the tiny model from its original-layout single file (the 1-stage run, conftest's
``auraflow_run``, reads the diffusers folder) on 2 pipeline stages in 2 processes through the real CLI; each stage saves
its share, and the saved diffusers LoRA, loaded with ``AuraFlowPipeline.load_lora_weights``, reproduces the
trained transformer."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from diffpipe_auraflow.testing import original_path
from diffpipe_core.testing import lora_project

pytestmark = pytest.mark.slow

STEPS = 6


@pytest.fixture(scope="module")
def two_stage_run(tmp_path_factory: pytest.TempPathFactory, tiny_auraflow: Path) -> Path:
    from test_auraflow_train import MODEL, make_project, run_config

    model = {**MODEL, "diffusion_model": original_path(Path("model")).name}
    toml = run_config(model, pipeline_stages=2, max_steps=STEPS, micro_batch_size_per_gpu=2)
    make = partial(make_project, tiny=tiny_auraflow)
    return lora_project.two_stage_run(tmp_path_factory.mktemp("auraflow-two-stages"), make, toml)


def test_trains_on_two_stages_from_the_single_file_and_the_lora_reproduces(two_stage_run: Path) -> None:
    from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel
    from test_auraflow_train import ALPHA, RANK, transformer_inputs

    lora_project.assert_two_stage_lora_reproduces(two_stage_run, STEPS, AuraFlowTransformer2DModel, AuraFlowPipeline,
                                                  RANK, ALPHA, transformer_inputs())
