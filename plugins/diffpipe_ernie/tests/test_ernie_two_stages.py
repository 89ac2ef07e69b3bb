"""ERNIE-Image's 2-stage training: the tiny model from ComfyUI's single file (the 1-stage run, conftest's
``ernie_run``, reads the diffusers folder) on 2 pipeline stages in 2 processes through the real CLI, with captions of
different lengths in a micro-batch, so the text mask, the rotary angles and the shared modulation cross the stage
boundary with a shape that changes between micro-batches; each stage saves its share, and the saved diffusers LoRA,
loaded with ``ErnieImagePipeline.load_lora_weights``, reproduces the trained transformer."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.adapters import read_adapter
from diffpipe_core.testing import runs
from diffpipe_ernie.testing import comfy_path

pytestmark = pytest.mark.slow

STEPS = 4


@pytest.fixture(scope="module")
def two_stage_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_ernie_train import MODEL, make_project, run_config

    root = make_project(tmp_path_factory.mktemp("ernie-two-stages"))
    model = {**MODEL, "diffusion_model": comfy_path(root / "model").name}
    (root / "run.toml").write_text(run_config(model, pipeline_stages=2, max_steps=STEPS, micro_batch_size_per_gpu=2))
    return runs.train(root, "run.toml", 2, timeout=600, OMP_NUM_THREADS="1")


def test_trains_on_two_stages_from_the_comfyui_file_and_the_lora_reproduces(two_stage_run: Path) -> None:
    from diffusers import ErnieImagePipeline, ErnieImageTransformer2DModel
    from test_ernie_train import ALPHA, RANK, transformer_inputs

    runs.assert_trained_in_stages(two_stage_run, STEPS, 2)
    model_dir, saved = two_stage_run.parent.parent / "model", two_stage_run / "saved" / "final"
    _, cfg = read_adapter(saved)
    fresh = ErnieImageTransformer2DModel.from_pretrained(str(model_dir / "transformer"))
    reference = runs.with_trained_lora(fresh, two_stage_run, RANK, ALPHA, cfg["target_modules"])
    pipe = ErnieImagePipeline.from_pretrained(str(model_dir), local_files_only=True)
    untrained = runs.outputs(pipe.transformer, transformer_inputs())
    runs.load_lora_into(pipe, saved / "adapter_model.safetensors")
    got = runs.outputs(pipe.transformer, transformer_inputs())
    runs.assert_reproduces(got, runs.outputs(reference, transformer_inputs()), untrained)
