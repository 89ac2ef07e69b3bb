"""End-to-end through the real CLI (DeepSpeed on gloo, the real cache, peft), issue points 3 and 4, on the one shared
``wan`` run (conftest.py's ``wan_run``): mp4 clips and images cached together, 1 stage in 1 process from the
original-layout single file, the loss falling; the saved diffusers LoRA loads with ``WanPipeline.load_lora_weights``
and reproduces the trained transformer on clips and images; the ComfyUI file has exactly the keys ComfyUI's key map
makes for Wan (``diffusion_model.<original module>``, alpha included) and applies to the original weights like the
trained LoRAs merged; the sample before the first step, through the pipeline engine, is ``WanPipeline``'s and an
MP4 of the dataset's 5 frames at the model's 16 fps.

The times are limited to t >= 0.8 (``min_t``), where the tiny model can learn to tell each caption's clean latents
from the noise within 40 steps, so that the per-step loss, which swings with the sampled time, falls clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.testing import comfy, runs
from diffpipe_core.testing.media import assert_video_sample_point, write_dataset_toml, write_image_dataset
from diffpipe_wan.original import layout
from diffpipe_wan.testing import single_file_path, write_clips, write_tiny_wan

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS = 4, 8.0, 40
MODEL = {"type": "wan", "text_max_length": 8, "timestep_sample_method": "uniform", "min_t": 0.8}
SAMPLE = {"prompts": ["a red cat"], "before_first_step": True, "steps": 2, "seed": 5, "resolution": 32}
CAPTIONS = ["a red car moving", "a river in a city", "a dog running", "a bright sky"]
#: the LoRA targets of every block, original names (the image-to-video k_img / v_img are absent from a T2V model)
BLOCK_TARGETS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k")
BLOCK_TARGETS += ("cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")


def make_project(root: Path) -> Path:
    """The tiny Wan 2.1 T2V, 4 mp4 clips of 5 frames at 16 fps and 4 images, all 32x32, in 1- and 5-frame buckets."""
    write_tiny_wan(root / "model")
    write_clips(root / "media", CAPTIONS, frames=5, size=(32, 32))
    write_image_dataset(root / "media", 4, size=(32, 32), captions=[f"a photo of {c[2:]}" for c in CAPTIONS])
    write_dataset_toml(
        root / "dataset.toml", root / "media", resolutions=[32], enable_ar_bucket=False, frame_buckets=[1, 5]
    )
    model = {**MODEL, "diffusion_model": single_file_path(root / "model").name}
    top = {"max_steps": STEPS, "pipeline_stages": 1, "checkpoint_every_n_steps": STEPS, "seed": 3}
    (root / "run.toml").write_text(runs.lora_run_toml(model, 1e-2, SAMPLE, RANK, ALPHA, **top))
    return root / "run.toml"


def model_dir(run: Path) -> Path:
    return run.parent.parent / "model"


def test_loss_falls_on_clips_and_images(wan_run: Path) -> None:
    from diffpipe_core.data.cache_store import list_shards

    runs.assert_loss_falls(wan_run, STEPS, 8)
    assert runs.stage_files(wan_run) == ["params-stage0.safetensors"]
    cache = wan_run.parent.parent / "cache"
    frames = {shard.columns["latents"][0][1] for media in cache.rglob("media") for shard in list_shards(media)}
    assert frames == {1, 2}, frames  # images (1 latent frame) and 5-frame clips (2 latent frames) both trained


def transformer_inputs(frames: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(frames)
    return {
        "hidden_states": torch.randn(2, 4, frames, 4, 4, generator=g),
        "timestep": torch.rand(2, generator=g) * 1000,
        "encoder_hidden_states": torch.randn(2, 8, 32, generator=g),
    }


def test_diffusers_lora_loads_in_wan_pipeline_and_reproduces(wan_run: Path) -> None:
    from diffusers import WanPipeline, WanTransformer3DModel

    saved = wan_run / "saved" / "final"
    state, cfg = runs.read_saved_lora(saved, RANK, ALPHA)
    assert all(k.startswith("transformer.blocks.") for k in state)
    assert {"transformer.blocks.0.attn1.to_q.lora_A.weight", "transformer.blocks.1.ffn.net.2.lora_B.weight"} <= set(
        state
    )
    fresh = WanTransformer3DModel.from_pretrained(str(model_dir(wan_run) / "transformer"))
    reference = runs.with_trained_lora(fresh, wan_run, RANK, ALPHA, cfg["target_modules"])

    # trained with alpha != rank, saved folded: reproducing the outputs proves the strength arrives
    pipe = WanPipeline.from_pretrained(str(model_dir(wan_run)), local_files_only=True)
    untrained = runs.outputs(pipe.transformer, transformer_inputs(2))
    runs.load_lora_into(pipe, saved / "adapter_model.safetensors")
    assert pipe.transformer.peft_config["trained"].lora_alpha == RANK
    for frames in (1, 2):  # an image and a clip
        got = runs.outputs(pipe.transformer, transformer_inputs(frames))
        expected = runs.outputs(reference, transformer_inputs(frames))
        assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    runs.assert_reproduces(got, expected, untrained)


def test_comfyui_lora_has_comfyuis_wan_keys_and_applies(wan_run: Path) -> None:
    file = load_file(str(wan_run / "saved" / "final" / "adapter_model.comfyui.safetensors"))
    original = load_file(str(single_file_path(model_dir(wan_run))))
    modules = {f"diffusion_model.blocks.{i}.{m}" for i in range(2) for m in BLOCK_TARGETS}
    assert set(file) == {f"{m}.{s}" for m in modules for s in ("lora_A.weight", "lora_B.weight", "alpha")}
    assert all(float(file[f"{m}.alpha"]) == RANK for m in modules)
    assert modules <= set(comfy.generic_key_map(original))  # the names ComfyUI's key map gives the Wan model

    # Applied to the original weights as ComfyUI does (W += alpha / rank * B @ A), the trained LoRAs merged.
    applied = runs.apply_comfyui(original, file)
    folder = load_file(str(model_dir(wan_run) / "transformer" / "diffusion_pytorch_model.safetensors"))
    merged = runs.merge_peft(folder, runs.checkpoint_params(wan_run), ALPHA / RANK)
    runs.assert_state_close(layout(2).to_model(applied), merged)
    moved = [k for k in merged if k.endswith("ffn.net.2.weight") and not torch.equal(merged[k], folder[k])]
    assert len(moved) == 2


def test_sample_before_the_first_step_is_wan_pipelines_as_an_mp4(wan_run: Path) -> None:
    """Sampled through the pipeline engine before the first step (LoRA B = 0: the base model): the MP4 has the
    dataset's 5 frames at 16 fps, and its latents are ``WanPipeline``'s for the same prompt, seed and steps."""
    from diffusers import WanPipeline

    from diffpipe_core.sampling.loop import noise_generator

    folder = wan_run / "samples" / "step-0000000"
    assert_video_sample_point(folder, fps=16, frames=5)
    got = load_file(str(folder / "latents.safetensors"))["sample_00"]
    pipe = WanPipeline.from_pretrained(str(model_dir(wan_run)), local_files_only=True)
    expected = pipe(
        prompt="a red cat",
        max_sequence_length=8,  # the run's text_max_length
        guidance_scale=1.0,  # [sample] cfg's default: no guidance
        latents=torch.randn(1, 4, 2, 4, 4, generator=noise_generator(5, 0)),  # the core's noise for seed 5, prompt 0
        num_inference_steps=2,
        height=32,
        width=32,
        num_frames=5,
        output_type="latent",
    ).frames
    torch.testing.assert_close(got.reshape(expected.shape), expected, rtol=1e-4, atol=1e-5)
