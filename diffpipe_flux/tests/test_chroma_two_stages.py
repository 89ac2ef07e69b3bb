"""Issue 24, Chroma's 2-stage training: the tiny Chroma from its diffusers folder (the 1-stage run, conftest's
``chroma_run``, reads Chroma's original single file) on 2 pipeline stages in 2 processes through the real CLI. The
distilled-guidance approximator's modulation crosses the stage boundary with the image and text streams; each stage
saves its share, and the saved diffusers LoRA, loaded with ``ChromaPipeline.load_lora_weights``, reproduces the
trained transformer."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.adapters import read_adapter
from diffpipe_core.testing import runs

pytestmark = pytest.mark.slow

STEPS = 6


@pytest.fixture(scope="module")
def two_stage_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_chroma_train import make_project, run_config

    root = tmp_path_factory.mktemp("chroma-two-stages")
    run_toml = make_project(root)
    # the diffusers folder; samples: the 1-stage run's
    run_toml.write_text(run_config(STEPS, single_file=False, sample=False, pipeline_stages=2))
    return runs.train(root, run_toml, 2, timeout=600, OMP_NUM_THREADS="1")


def test_trains_on_two_stages_from_the_folder_and_the_lora_reproduces(two_stage_run: Path) -> None:
    from diffusers import ChromaPipeline, ChromaTransformer2DModel
    from test_chroma_train import ALPHA, RANK, model_dir, transformer_inputs

    runs.assert_trained_in_stages(two_stage_run, STEPS, 2)
    saved = two_stage_run / "saved" / "final"
    _, cfg = read_adapter(saved)
    fresh = ChromaTransformer2DModel.from_pretrained(str(model_dir(two_stage_run) / "transformer"))
    reference = runs.with_trained_lora(fresh, two_stage_run, RANK, ALPHA, cfg["target_modules"])
    pipe = ChromaPipeline.from_pretrained(str(model_dir(two_stage_run)), local_files_only=True)
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference, transformer_inputs())
