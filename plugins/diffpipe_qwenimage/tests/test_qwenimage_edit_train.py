"""Issue 23, test 3 (edit): ``qwen-image-edit`` trains on an edit dataset (targets with a ``control_path`` of
reference images) through the real CLI on 2 pipeline stages in 2 processes, then in 1 process from the same cache
with the same losses. Every pair's reference image is cached, its latents ride with the noisy target through both
stages, and the saved diffusers LoRA, loaded with ``QwenImageEditPipeline.load_lora_weights``, reproduces the
trained transformer on target + reference tokens. Text-to-image: test_qwenimage_train.py."""

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


def run_toml(stages: int) -> str:
    model = {"type": "qwen-image-edit", "path": "model", "dtype": "float32", "encoder_dtype": "float32"}
    model |= {"text_max_length": 32, "vl_image_area": 1024}
    top = {"max_steps": STEPS, "micro_batch_size_per_gpu": 2, "pipeline_stages": stages, "partition_split": [2]}
    top |= {"checkpoint_every_n_steps": STEPS, "seed": 3}
    if stages == 1:
        del top["partition_split"]
    return runs.run_toml(model, {"lr": 2e-2}, {"rank": RANK, "alpha": ALPHA}, **top)


INSTRUCTIONS = ["make it red", "add a dog", "turn it to night", "remove the tree"]


@pytest.fixture(scope="module")
def edit_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """4 edit pairs (32x32 target, 32x32 reference of the same stem), trained on 2 stages in 2 processes, then in 1
    process from the same cache. The run folders by stage count."""
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
    for stages in (2, 1):
        (root / f"run{stages}.toml").write_text(run_toml(stages))
    return {stages: runs.train(root, f"run{stages}.toml", stages, timeout=600) for stages in (2, 1)}


def test_edit_pairs_train_on_two_stages_and_one_alike(edit_runs: dict[int, Path]) -> None:
    from diffpipe_core.data.cache_store import list_shards

    for stages, run in edit_runs.items():
        runs.assert_trained_in_stages(run, STEPS, stages)
    # the pipeline split changes nothing: same data, noise and weights
    assert runs.losses(edit_runs[1]) == pytest.approx(runs.losses(edit_runs[2]), rel=1e-4)
    tables = list((edit_runs[2].parent.parent / "cache").rglob("controls"))
    keys = [key for table in tables for shard in list_shards(table) for key in shard.keys]
    assert len(keys) == len(INSTRUCTIONS), keys  # every pair's reference image was encoded
    assert all("latents" in shard.columns for table in tables for shard in list_shards(table))


def test_edit_lora_loads_in_the_edit_pipeline_and_reproduces_on_reference_tokens(edit_runs: dict[int, Path]) -> None:
    edit_run = edit_runs[2]
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
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference, inputs)


def test_comfyui_loads_the_edit_diffusers_file_at_the_trained_strength(edit_runs: dict[int, Path]) -> None:
    from test_qwenimage_train import comfyui_applies_the_diffusers_file

    comfyui_applies_the_diffusers_file(edit_runs[2], ALPHA, RANK)


@pytest.mark.slow
def test_component_files_train_as_the_folder(edit_runs: dict[int, Path]) -> None:
    """The 1-process edit run again from ComfyUI's files only (the transformer, the VAE and the Qwen2.5-VL file with
    its vision tower) beside a config-only folder (issue 35): equal losses and LoRA files."""
    from test_qwenimage_component_files import comfy_files

    from diffpipe_core.testing.component_files import assert_trains_as, model_keys, train_from_files

    root = edit_runs[1].parent.parent
    files = comfy_files(root / "model", root / "comfy")
    config = root / "run1_files.toml"
    config.write_text((root / "run1.toml").read_text())
    assert_trains_as(train_from_files(root, config, model_keys(files)), edit_runs[1])
