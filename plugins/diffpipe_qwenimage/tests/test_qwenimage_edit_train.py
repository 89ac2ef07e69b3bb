"""Issue 23, test 3 (edit, 2 stages): ``qwen-image-edit`` trains on an edit dataset (targets with a ``control_path``
of reference images) through the real CLI on 2 pipeline stages in 2 processes: every pair's reference image is
cached, its latents ride with the noisy target through both stages, and the saved diffusers LoRA, loaded with
``QwenImageEditPipeline.load_lora_weights``, reproduces the trained transformer on target + reference tokens. The
1-stage text-to-image run is test_qwenimage_train.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.adapters import read_adapter
from diffpipe_core.testing import runs
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_qwenimage.testing import load_pipeline, write_tiny_qwen

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS = 4, 8.0, 6
RUN_TOML = f"""
output_dir = "out"
dataset = "dataset.toml"
max_steps = {STEPS}
micro_batch_size_per_gpu = 2
pipeline_stages = 2
partition_split = [2]
checkpoint_every_n_steps = {STEPS}
save_dtype = "float32"
seed = 3

[model]
type = "qwen-image-edit"
path = "model"
dtype = "float32"
encoder_dtype = "float32"
text_max_length = 32
vl_image_area = 1024

[adapter]
rank = {RANK}
alpha = {ALPHA}

[optimizer]
lr = 2e-2
"""
INSTRUCTIONS = ["make it red", "add a dog", "turn it to night", "remove the tree"]


@pytest.fixture(scope="module")
def edit_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 edit pairs (32x32 target, 32x32 reference of the same stem), 2 stages, 2 processes. Its run folder."""
    root = tmp_path_factory.mktemp("qwen-edit-train")
    write_tiny_qwen(root / "model", "QwenImageEditPipeline")
    write_image_dataset(root / "data", 4, size=(32, 32), captions=INSTRUCTIONS)
    for png in write_image_dataset(root / "control", 4, size=(32, 32), seed=1):
        png.with_suffix(".txt").unlink()  # a reference folder holds images only
    write_dataset_toml(
        root / "dataset.toml",
        root / "data",
        directory_keys={"control_path": root / "control"},
        resolutions=[32],
        enable_ar_bucket=False,
    )
    (root / "run.toml").write_text(RUN_TOML)
    return runs.train(root, "run.toml", 2, timeout=600, OMP_NUM_THREADS="1")


def test_edit_pairs_train_with_two_stages(edit_run: Path) -> None:
    from diffpipe_core.data.cache_store import list_shards

    runs.assert_trained_in_stages(edit_run, STEPS, 2)
    tables = list((edit_run.parent.parent / "cache").rglob("controls"))
    keys = [key for table in tables for shard in list_shards(table) for key in shard.keys]
    assert len(keys) == len(INSTRUCTIONS), keys  # every pair's reference image was encoded
    assert all("latents" in shard.columns for table in tables for shard in list_shards(table))


def test_edit_lora_loads_in_the_edit_pipeline_and_reproduces_on_reference_tokens(edit_run: Path) -> None:
    from diffusers import QwenImageTransformer2DModel

    model_dir, saved = edit_run.parent.parent / "model", edit_run / "saved" / "final"
    _, cfg = read_adapter(saved)
    fresh = QwenImageTransformer2DModel.from_pretrained(str(model_dir / "transformer"))
    reference = runs.with_trained_lora(fresh, edit_run, RANK, ALPHA, cfg["target_modules"])
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    inputs = {
        "hidden_states": torch.randn(2, 8, 16, generator=g),  # 4 target tokens, then 4 reference tokens
        "encoder_hidden_states": torch.randn(2, 6, 32, generator=g),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.rand(2, generator=g),
        "img_shapes": [[(1, 2, 2), (1, 2, 2)]] * 2,
    }
    pipe = load_pipeline(model_dir)
    assert type(pipe).__name__ == "QwenImageEditPipeline"
    untrained = runs.outputs(pipe.transformer, inputs)
    runs.load_lora_into(pipe, saved / "adapter_model.safetensors")
    runs.assert_reproduces(runs.outputs(pipe.transformer, inputs), runs.outputs(reference, inputs), untrained)
