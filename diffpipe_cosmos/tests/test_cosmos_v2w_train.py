"""Video-to-world training through the real CLI (``[model] conditioning = "video"``), one shared 1-process run per
entry point (conftest.py) on tiny video-to-world models, images and clips mixed:

- the loss falls; each clip is conditioned on its first latent frame (images unconditioned);
- ``cosmos-predict2`` also on 2 pipeline stages in 2 processes, a few steps from the shared run's cache: the losses
  are the shared run's first ones (same data, noise and initial weights);
- the diffusers LoRA, loaded with ``transformer.load_lora_adapter`` (the video-to-world pipelines have no
  ``load_lora_weights``), reproduces the trained transformer on conditioned inputs (condition mask, per-frame
  timesteps);
- the ``cosmos-predict2`` run samples before its first step from ``[model] sample_video``: an MP4 whose latents are
  ``Cosmos2VideoToWorldPipeline``'s (test_cosmos_v2w.py compares the hooks to both pipelines in-process).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cosmos_common import VARIANTS
from test_cosmos_train import ALPHA, RANK, SAMPLE_TABLE, cached_latent_shapes, trained_reference, write_media

from diffpipe_core.testing import runs
from diffpipe_cosmos import resize
from diffpipe_cosmos.testing import TinyCosmosConfig, write_tiny_cosmos

pytestmark = pytest.mark.slow

STEPS, TWO_STAGE_STEPS = 20, 3
LR = {"cosmos": 5e-3, "cosmos-predict2": 1e-2}
FRAMES = {"cosmos": 9, "cosmos-predict2": 9}  # 2 latent frames (1.0 VAE: 8x), 3 (Wan VAE: 4x)
FPS = {"cosmos": 30, "cosmos-predict2": 16}  # the clips at the models' rates: every frame is a training frame
OBJECTIVE = {"cosmos": {"p_mean": 1.0, "p_std": 0.5}, "cosmos-predict2": {}}
V2W_SAMPLE_TABLE = SAMPLE_TABLE + "frames = 9\n"


def make_v2w_project(root: Path, name: str) -> Path:
    """A tiny video-to-world model, 6 images and 4 clips, and a LoRA run.toml conditioning on 1 latent frame (the
    ``cosmos-predict2`` one samples from ``media/clip_0.mp4`` before its first step)."""
    write_tiny_cosmos(root / "model", TinyCosmosConfig(variant=VARIANTS[name], video2world=True))
    media = root / "media"
    write_media(root, FRAMES[name], fps=FPS[name])
    model = {"type": name, "t5_max_length": 16, "conditioning": "video", "conditioning_frames": 1, **OBJECTIVE[name]}
    sample = ""
    if name == "cosmos-predict2":
        model["sample_video"] = str(media / "clip_0.mp4")
        sample = V2W_SAMPLE_TABLE
    top = {"gradient_accumulation_steps": 2, "pipeline_stages": 1, "checkpoint_every_n_steps": STEPS, "seed": 3}
    text = runs.lora_run_toml(model, LR[name], None, RANK, ALPHA, max_steps=STEPS, **top)
    (root / "run.toml").write_text(text + sample)
    return root / "run.toml"


RUNS = {"cosmos": "cosmos1_v2w_run", "cosmos-predict2": "predict2_v2w_run"}  # entry point -> its shared run


@pytest.fixture(params=list(RUNS))
def run(request: pytest.FixtureRequest) -> tuple[str, Path]:
    return request.param, request.getfixturevalue(RUNS[request.param])


def test_v2w_loss_falls_on_images_and_clips(run: tuple[str, Path]) -> None:
    name, path = run
    runs.assert_loss_falls(path, STEPS, 5)
    latent_frames = (FRAMES[name] - 1) // (8 if name == "cosmos" else 4) + 1
    assert {shape[1] for shape in cached_latent_shapes(path)} == {1, latent_frames}


@pytest.fixture(scope="module")
def two_stage_run(predict2_v2w_run: Path) -> tuple[Path, Path]:
    """``(the 2-stage run, the shared run)``: the shared run's config on 2 stages, its cache, a few steps."""
    root = predict2_v2w_run.parent.parent
    text = (root / "run.toml").read_text()
    text = text[: text.index("[sample]")].replace("pipeline_stages = 1", "pipeline_stages = 2")
    text = text.replace(f"max_steps = {STEPS}", f"max_steps = {TWO_STAGE_STEPS}")
    text = text.replace(f"checkpoint_every_n_steps = {STEPS}", f"checkpoint_every_n_steps = {TWO_STAGE_STEPS}")
    (root / "two_stages.toml").write_text(text)
    return runs.train(root, "two_stages.toml", 2, timeout=600), predict2_v2w_run


def test_v2w_two_stages_train_as_one(two_stage_run: tuple[Path, Path]) -> None:
    run_dir, shared = two_stage_run
    runs.assert_trained_in_stages(run_dir, TWO_STAGE_STEPS, 2)
    assert runs.losses(run_dir) == pytest.approx(runs.losses(shared)[:TWO_STAGE_STEPS], rel=1e-4)


def conditioned_inputs(name: str) -> dict:
    """Transformer inputs of a 3-frame latent clip conditioned on its first frame (Predict2: per-frame timesteps)."""
    g = torch.Generator().manual_seed(0)
    frames = 3
    cond = torch.zeros(1, 1, frames, 1, 1)
    cond[:, :, :1] = 1.0
    timestep = torch.rand(1, generator=g)
    if name == "cosmos-predict2":
        timestep = cond * 1e-4 + (1 - cond) * timestep.view(1, 1, 1, 1, 1)
    return {
        "hidden_states": torch.randn(1, 4, frames, 4, 6, generator=g),
        "timestep": timestep,
        "encoder_hidden_states": torch.randn(1, 16, 16, generator=g),
        "fps": 16,
        "condition_mask": cond.expand(1, 1, frames, 4, 6).clone(),
        "padding_mask": torch.zeros(1, 1, 32, 48),
    }


def test_v2w_lora_reproduces_the_trained_transformer(run: tuple[str, Path]) -> None:
    from diffusers import CosmosTransformer3DModel

    resize.install()
    name, path = run
    model_dir = path.parent.parent / "model"
    saved = path / "saved" / "final"
    _, cfg = runs.read_saved_lora(saved, RANK, ALPHA)
    reference = trained_reference(path, model_dir, cfg["target_modules"])
    fresh = CosmosTransformer3DModel.from_pretrained(str(model_dir / "transformer")).eval()
    assert fresh.config.in_channels == fresh.config.out_channels + 1  # the video-to-world transformer
    inputs = conditioned_inputs(name)
    untrained = runs.outputs(fresh, inputs)
    fresh.load_lora_adapter(
        str(saved), weight_name="adapter_model.safetensors", prefix="transformer", adapter_name="trained"
    )
    runs.assert_reproduces(runs.outputs(fresh, inputs), runs.outputs(reference, inputs), untrained)


def test_v2w_run_samples_what_the_pipeline_makes(predict2_v2w_run: Path) -> None:
    """Before the first step (LoRA B = 0) the run's sample, conditioned on ``[model] sample_video``, is the
    video-to-world pipeline's for the same seed: a 9-frame MP4 at 16 fps."""
    import av
    from safetensors.torch import load_file
    from test_cosmos_v2w import pipeline_v2w_latents

    folder = predict2_v2w_run / "samples" / "step-0000000"
    with av.open(str(folder / "00-a-red-cat.mp4")) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == 16 and len(list(container.decode(stream))) == 9
    root = predict2_v2w_run.parent.parent
    got = load_file(str(folder / "latents.safetensors"))["sample_00"]
    expected = pipeline_v2w_latents("cosmos-predict2", root / "model", root / "media" / "clip_0.mp4", 9, 1.0)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
