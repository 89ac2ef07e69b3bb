"""``cosmos-predict2.5`` through the real CLI (DeepSpeed on gloo, the real cache, peft): the shared 1-process run on
generated images and mp4 clips (conftest.py) and, from its cache, a few steps on 2 pipeline stages in 2 processes
that also sample before the first step. The loss falls; the diffusers LoRA loads with
``Cosmos2_5_PredictBasePipeline.load_lora_weights`` and reproduces the trained transformer; the ComfyUI file,
applied to NVIDIA's layout as ComfyUI applies it, equals the trained LoRAs merged; the 2-stage run trains as the
1-process one and its sample (an MP4, made through the pipeline engine with the UniPC steps) is the pipeline's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_cosmos_train import write_media

from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.testing import runs
from diffpipe_core.testing.media import assert_video_sample_point
from diffpipe_cosmos import resize
from diffpipe_cosmos.testing import to_diffusers, to_nvidia
from diffpipe_cosmos.testing_predict25 import write_tiny_predict25

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS, STAGE_STEPS, LENGTH = 4, 8.0, 20, 4, 32
SAMPLE = '\n[sample]\nprompts = ["a red cat"]\nbefore_first_step = true\nsteps = 3\nseed = 5\nresolution = [48, 32]\n'


def make_project(root: Path, stages: int, steps: int) -> Path:
    """A tiny 2.5 folder, 6 captioned images and 4 captioned 7-frame clips (5-frame bucket), a rank-4 LoRA run."""
    write_tiny_predict25(root / "model")
    write_media(root, 5)  # Predict2's media: 5-frame clips (7 written, at 20 fps)
    model = {"type": "cosmos-predict2.5", "text_max_length": LENGTH}
    top = {"gradient_accumulation_steps": 2, "pipeline_stages": stages, "checkpoint_every_n_steps": steps, "seed": 3}
    (root / "run.toml").write_text(runs.lora_run_toml(model, 2e-2, None, RANK, ALPHA, max_steps=steps, **top))
    return root / "run.toml"


@pytest.fixture(scope="module")
def two_stage_run(predict25_run: Path) -> Path:
    """A few steps of the shared run's project on 2 stages in 2 processes (its cache), sampling first."""
    root = predict25_run.parent.parent
    text = (root / "run.toml").read_text().replace("pipeline_stages = 1", "pipeline_stages = 2")
    text = text.replace(f"max_steps = {STEPS}", f"max_steps = {STAGE_STEPS}")
    text = text.replace(f"checkpoint_every_n_steps = {STEPS}", f"checkpoint_every_n_steps = {STAGE_STEPS}")
    (root / "two_stages.toml").write_text(text + SAMPLE)
    return runs.train(root, "two_stages.toml", procs=2, timeout=600)


def test_loss_falls_on_images_and_clips(predict25_run: Path) -> None:
    from diffpipe_core.data.cache_store import list_shards

    runs.assert_loss_falls(predict25_run, STEPS, 5)
    assert json.loads((predict25_run / "run_info.json").read_text())["num_procs"] == 1
    cache = predict25_run.parent.parent / "cache"
    shapes = [s.columns["latents"][0] for media in cache.rglob("media") for s in list_shards(media)]
    assert {shape[1] for shape in shapes} == {1, 2}, shapes  # images (1 latent frame) and clips (2)


def transformer_inputs(frames: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(1, 4, frames, 4, 6, generator=g),
        "timestep": torch.rand(1, generator=g),
        "encoder_hidden_states": torch.randn(1, LENGTH, 64, generator=g),
        "condition_mask": torch.zeros(1, 1, frames, 4, 6),
        "padding_mask": torch.zeros(1, 1, 32, 48),
    }


def test_diffusers_lora_loads_with_load_lora_weights_and_reproduces(predict25_run: Path) -> None:
    from diffusers import Cosmos2_5_PredictBasePipeline, CosmosTransformer3DModel
    from test_cosmos_predict25 import NoGuardrail

    resize.install()
    model_dir, saved = predict25_run.parent.parent / "model", predict25_run / "saved" / "final"
    trained = ("transformer_blocks.1.attn2.to_k.lora_A.weight", "transformer_blocks.1.ff.net.2.lora_B.weight")
    _, cfg = runs.read_saved_lora(saved, RANK, ALPHA, holding=trained)
    peft_names = tuple(k.replace(".weight", ".default.weight") for k in trained)
    reference = runs.trained_transformer(
        CosmosTransformer3DModel, predict25_run, model_dir, RANK, ALPHA, cfg["target_modules"], peft_names
    )
    pipe = Cosmos2_5_PredictBasePipeline.from_pretrained(str(model_dir), safety_checker=NoGuardrail())
    # a clip's latents; alpha != rank: reproducing also proves the strength read from the file's metadata
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference, transformer_inputs(2), ALPHA)


def test_comfyui_lora_applies_to_nvidias_layout(predict25_run: Path) -> None:
    comfy = load_file(str(predict25_run / "saved" / "final" / "adapter_model.comfyui.safetensors"))
    assert float(comfy["diffusion_model.blocks.0.self_attn.q_proj.alpha"]) == RANK
    assert len(comfy) == 3 * 10 * 2  # lora_A, lora_B, alpha x 10 linears x 2 blocks
    folder = predict25_run.parent.parent / "model" / "transformer" / "diffusion_pytorch_model.safetensors"
    # Predict2's table: 2.5 adds only crossattn_proj, which no LoRA targets
    original = {k: v for k, v in load_file(str(folder)).items() if not k.startswith("crossattn_proj.")}
    base = {k.removeprefix("net."): v for k, v in to_nvidia(original, "predict2").items()}
    merged = runs.merge_peft(original, runs.checkpoint_params(predict25_run), ALPHA / RANK)
    runs.assert_state_close(to_diffusers(runs.apply_comfyui(base, comfy), "predict2"), merged)


def test_two_stages_train_as_one_and_sample_the_pipelines(two_stage_run: Path, predict25_run: Path) -> None:
    from test_cosmos_predict25 import config, pipeline

    from diffpipe_core.registry import get_registry
    from diffpipe_core.sampling.prompts import encode_prompts

    runs.assert_trained_in_stages(two_stage_run, STAGE_STEPS, 2)
    assert runs.losses(two_stage_run) == pytest.approx(runs.losses(predict25_run)[:STAGE_STEPS], rel=1e-4)
    folder = two_stage_run / "samples" / "step-0000000"
    assert_video_sample_point(folder, 16, 5)
    model_dir = predict25_run.parent.parent / "model"
    cfg = config(model_dir)
    (texts,) = encode_prompts(get_registry().model("cosmos-predict2.5"), cfg, ["a red cat"], "", torch.device("cpu"))
    noise = torch.randn((1, 4, 2, 4, 6), generator=noise_generator(5, 0))  # [sample] seed 5, prompt 0
    expected = pipeline(model_dir)(
        prompt_embeds=texts.cond["text_embeds"],
        latents=noise,
        num_inference_steps=3,
        guidance_scale=1.0,
        height=32,
        width=48,
        num_frames=5,
        output_type="latent",
    ).frames
    got = load_file(str(folder / "latents.safetensors"))["sample_00"]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
