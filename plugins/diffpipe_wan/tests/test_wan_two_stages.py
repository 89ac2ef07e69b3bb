"""Issue 22, test 3 with 2 pipeline stages, through the real CLI (2 processes, DeepSpeed on gloo): image-to-video
(``wan-i2v``, Wan 2.1 I2V with its CLIP vision encoder) trains on clips, and a Wan 2.2 A14B run with
``expert = "low"`` fine-tunes the whole low-noise transformer on mixed clips and images from the diffusers folder.
Each run is short: what they add to the 1-stage run (test_wan_train.py) is the stage split, the first-frame
conditioning carried through it, and the expert selection. The I2V LoRA reproduces the trained model in
``WanImageToVideoPipeline``; the A14B run's saved diffusers folder is ``transformer_2`` moved a little (a full
fine-tune, so the weights show which expert was trained), far from ``transformer``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel

from diffpipe_core.adapters import read_adapter
from diffpipe_core.testing import runs
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_wan.testing import TinyWanConfig, write_clips, write_tiny_wan

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS = 4, 8.0, 6
LORA = {"rank": RANK, "alpha": ALPHA}
EXPERTS = ("transformer_2", "transformer")  # low-noise (trained), high-noise
CAPTIONS = ["a red car moving", "a river in a city", "a dog running", "a bright sky"]


def _run(root: Path, model: TinyWanConfig, table: dict, *, images: bool, lora: bool) -> Path:
    """Train ``model`` with the ``[model]`` keys ``table`` on 4 clips (and 4 images), 2 stages in 2 processes."""
    write_tiny_wan(root / "model", model)
    write_clips(root / "media", CAPTIONS, frames=5, size=(32, 32))
    if images:
        write_image_dataset(root / "media", 4, size=(32, 32), captions=[f"a photo of {c[2:]}" for c in CAPTIONS])
    write_dataset_toml(
        root / "dataset.toml", root / "media", resolutions=[32], enable_ar_bucket=False, frame_buckets=[1, 5]
    )
    top = {"max_steps": STEPS, "micro_batch_size_per_gpu": 2, "pipeline_stages": 2, "partition_split": [2]}
    top |= {"checkpoint_every_n_steps": STEPS, "seed": 3}
    table = {"path": "model", "dtype": "float32", "encoder_dtype": "float32", **table}
    if lora:
        toml = runs.run_toml(table, {"lr": 1e-2}, LORA, **top)
    else:
        toml = runs.run_toml(table, {"lr": 1e-4}, save_model_formats=["diffusers"], **top)
    (root / "run.toml").write_text(toml)
    return runs.train(root, root / "run.toml", procs=2, timeout=600, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def i2v_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``wan-i2v`` on 4 clips, 2 stages; a CLIP I2V transformer attends to exactly 512 text tokens."""
    table = {"type": "wan-i2v", "text_max_length": 512}
    root = tmp_path_factory.mktemp("wan-i2v-2")
    return _run(root, TinyWanConfig(i2v=True, clip=True), table, images=False, lora=True)


@pytest.fixture(scope="module")
def a14b_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``wan`` with ``expert = "low"`` on a two-expert folder, clips and images, 2 stages, a full fine-tune saved
    also as a diffusers folder."""
    table = {"type": "wan", "text_max_length": 8, "expert": "low"}
    root = tmp_path_factory.mktemp("wan-a14b-2")
    return _run(root, TinyWanConfig(boundary_ratio=0.875), table, images=True, lora=False)


def _reference(run: Path, component: str) -> torch.nn.Module:
    _, cfg = read_adapter(run / "saved" / "final")
    fresh = WanTransformer3DModel.from_pretrained(str(run.parent.parent / "model" / component))
    return runs.with_trained_lora(fresh, run, RANK, ALPHA, cfg["target_modules"])


def test_i2v_trains_with_two_stages_and_its_lora_reproduces_in_the_i2v_pipeline(i2v_run: Path) -> None:
    from diffusers import WanImageToVideoPipeline

    runs.assert_trained_in_stages(i2v_run, STEPS, 2)
    g = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(2, 12, 2, 4, 4, generator=g),  # noisy latents, 4 mask channels, first frame
        "timestep": torch.rand(2, generator=g) * 1000,
        "encoder_hidden_states": torch.randn(2, 512, 32, generator=g),
        "encoder_hidden_states_image": torch.randn(2, 5, 16, generator=g),
    }
    pipe = WanImageToVideoPipeline.from_pretrained(str(i2v_run.parent.parent / "model"), local_files_only=True)
    lora = i2v_run / "saved" / "final" / "adapter_model.safetensors"
    runs.assert_lora_reproduces(pipe, lora, _reference(i2v_run, "transformer"), inputs)


def test_a14b_low_expert_fine_tunes_only_transformer_2_with_two_stages(a14b_run: Path) -> None:
    from safetensors.torch import load_file

    runs.assert_trained_in_stages(a14b_run, STEPS, 2)
    saved = a14b_run / "saved" / "final" / "diffusers"
    trained = WanTransformer3DModel.from_pretrained(str(saved), local_files_only=True).state_dict()
    model = a14b_run.parent.parent / "model"
    low, high = (load_file(str(model / part / "diffusion_pytorch_model.safetensors")) for part in EXPERTS)
    assert trained.keys() == low.keys()
    moved = max(float((trained[k] - low[k]).abs().max()) for k in low)
    from_high = max(float((trained[k] - high[k]).abs().max()) for k in high)
    # 6 AdamW steps at lr 1e-4 move a weight by at most ~6e-4; the two experts' random weights differ by ~0.1
    assert 0 < moved < 2e-3 < from_high, (moved, from_high)


@pytest.mark.slow
def test_i2v_component_files_train_as_the_folder(i2v_run: Path) -> None:
    """The 2-stage ``wan-i2v`` run again from ComfyUI's files only (the transformer, the Wan VAE, umt5 and
    ``clip_vision_h`` in ``text_encoders``) beside a config-only folder (issue 35): equal losses and LoRA files."""
    from test_wan_component_files import comfy_files

    from diffpipe_core.testing.component_files import assert_trains_as, train_from_files

    root = i2v_run.parent.parent
    files = comfy_files(root / "model", root / "comfy")
    keys = {"path": str(files["configs"]), "diffusion_model": str(files["diffusion_model"]), "vae": str(files["vae"])}
    keys["text_encoders"] = [str(p) for p in files["text_encoders"]]
    config = root / "run_files.toml"
    config.write_text((root / "run.toml").read_text())
    assert_trains_as(train_from_files(root, config, keys, procs=2, OMP_NUM_THREADS="1"), i2v_run)
