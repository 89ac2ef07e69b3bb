"""SD3's 2-stage training: the tiny model from its Stability-layout single file (the 1-stage run, conftest's
``sd3_run``, reads the diffusers folder) on 2 pipeline stages in 2 processes through the real CLI; each stage saves
its share, and the saved diffusers LoRA, loaded with ``StableDiffusion3Pipeline.load_lora_weights``, reproduces the
trained transformer."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.adapters import read_adapter
from diffpipe_core.testing import runs
from diffpipe_sd3.testing import original_path

pytestmark = pytest.mark.slow

STEPS = 6


@pytest.fixture(scope="module")
def two_stage_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_sd3_train import MODEL, make_project, run_config

    root = make_project(tmp_path_factory.mktemp("sd3-two-stages"))
    model = {**MODEL, "diffusion_model": original_path(root / "model").name}
    (root / "run.toml").write_text(run_config(model, pipeline_stages=2, max_steps=STEPS, micro_batch_size_per_gpu=2))
    return runs.train(root, "run.toml", 2, timeout=600, OMP_NUM_THREADS="1")


def test_trains_on_two_stages_from_the_single_file_and_the_lora_reproduces(two_stage_run: Path) -> None:
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from test_sd3_train import ALPHA, RANK, transformer_inputs

    runs.assert_trained_in_stages(two_stage_run, STEPS, 2)
    model_dir, saved = two_stage_run.parent.parent / "model", two_stage_run / "saved" / "final"
    _, cfg = read_adapter(saved)
    fresh = SD3Transformer2DModel.from_pretrained(str(model_dir / "transformer"))
    reference = runs.with_trained_lora(fresh, two_stage_run, RANK, ALPHA, cfg["target_modules"])
    pipe = StableDiffusion3Pipeline.from_pretrained(str(model_dir), local_files_only=True)
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference, transformer_inputs())
