"""SkyReels V2 end-to-end through the real CLI (DeepSpeed on gloo, the real cache, peft) on the one shared run
(conftest.py's ``skyreels_run``): diffusion forcing (a ``SkyReelsV2DiffusionForcingPipeline`` folder whose transformer
has the frame-rate embedding), 1 stage in 1 process from the original-layout single file, clips and images; the
saved diffusers LoRA loads with ``SkyReelsV2DiffusionForcingPipeline.load_lora_weights`` and reproduces the trained
transformer on per-frame times; the ComfyUI file has exactly ComfyUI's Wan keys (ComfyUI loads SkyReels V2 as its
Wan 2.1 model) and applies to the original weights like the trained LoRAs merged; the sample before the first step,
through the pipeline engine, is the diffusion-forcing pipeline's for the same seed, as an MP4 at 24 fps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_wan_train import BLOCK_TARGETS

from diffpipe_core.testing import comfy, runs
from diffpipe_core.testing.media import assert_video_sample_point
from diffpipe_wan.skyreels_keys import layout_for_config
from diffpipe_wan.skyreels_testing import single_file_path, write_tiny_skyreels

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS = 4, 8.0, 30
MODEL = {"type": "skyreels-v2", "text_max_length": 8, "timestep_sample_method": "uniform", "min_t": 0.8}
SAMPLE = {"prompts": ["a red cat"], "before_first_step": True, "steps": 2, "seed": 5, "resolution": 32}


def make_project(root: Path) -> Path:
    """``test_wan_train``'s project (4 mp4 clips of 5 frames and 4 images, 32x32, its dataset.toml) with the tiny
    SkyReels V2 DF folder (with ``fps_embedding``) in place of its Wan and this run's ``run.toml``."""
    import shutil

    from test_wan_train import make_project as wan_project

    wan_project(root)
    shutil.rmtree(root / "model")
    write_tiny_skyreels(root / "model", "df", fps=True)
    model = {**MODEL, "diffusion_model": single_file_path(root / "model").name}
    top = {"max_steps": STEPS, "pipeline_stages": 1, "checkpoint_every_n_steps": STEPS, "seed": 3}
    (root / "run.toml").write_text(runs.lora_run_toml(model, 1e-2, SAMPLE, RANK, ALPHA, **top))
    return root / "run.toml"


def model_dir(run: Path) -> Path:
    return run.parent.parent / "model"


def test_diffusion_forcing_trains(skyreels_run: Path) -> None:
    losses = runs.losses(skyreels_run)
    assert len(losses) == STEPS and all(0 < v < 10 for v in losses)
    runs.assert_loss_falls(skyreels_run, STEPS, 8)


def transformer_inputs(frames: int) -> dict[str, torch.Tensor]:
    """One clip (the DF forward adds its frame-rate embedding right for one sample), a time per latent frame."""
    g = torch.Generator().manual_seed(frames)
    times = torch.sort(torch.rand(1, frames, generator=g) * 1000).values
    return {
        "hidden_states": torch.randn(1, 4, frames, 4, 4, generator=g),
        "timestep": times,
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
        "enable_diffusion_forcing": True,
        "fps": [1],
    }


def test_diffusers_lora_loads_in_the_df_pipeline_and_reproduces(skyreels_run: Path) -> None:
    from diffusers import SkyReelsV2DiffusionForcingPipeline, SkyReelsV2Transformer3DModel

    saved = skyreels_run / "saved" / "final"
    state, cfg = runs.read_saved_lora(saved, RANK, ALPHA)
    assert all(k.startswith("transformer.blocks.") for k in state)
    fresh = SkyReelsV2Transformer3DModel.from_pretrained(str(model_dir(skyreels_run) / "transformer"))
    reference = runs.with_trained_lora(fresh, skyreels_run, RANK, ALPHA, cfg["target_modules"])
    pipe = SkyReelsV2DiffusionForcingPipeline.from_pretrained(str(model_dir(skyreels_run)), local_files_only=True)
    runs.assert_lora_reproduces(pipe, saved / "adapter_model.safetensors", reference, transformer_inputs(2), ALPHA)
    assert torch.allclose(runs.outputs(pipe.transformer, transformer_inputs(1)),
                          runs.outputs(reference, transformer_inputs(1)), atol=1e-5)  # fmt: skip


def test_comfyui_lora_has_comfyuis_wan_keys_and_applies(skyreels_run: Path) -> None:
    file = load_file(str(skyreels_run / "saved" / "final" / "adapter_model.comfyui.safetensors"))
    original = load_file(str(single_file_path(model_dir(skyreels_run))))
    modules = {f"diffusion_model.blocks.{i}.{m}" for i in range(2) for m in BLOCK_TARGETS}
    assert set(file) == {f"{m}.{s}" for m in modules for s in ("lora_A.weight", "lora_B.weight", "alpha")}
    assert modules <= set(comfy.generic_key_map(original))
    applied = runs.apply_comfyui(original, file)
    folder = load_file(str(model_dir(skyreels_run) / "transformer" / "diffusion_pytorch_model.safetensors"))
    merged = runs.merge_peft(folder, runs.checkpoint_params(skyreels_run), ALPHA / RANK)
    import json

    config = json.loads((model_dir(skyreels_run) / "transformer" / "config.json").read_text())
    runs.assert_state_close(layout_for_config(config).to_model(applied), merged)


def test_sample_before_the_first_step_is_the_df_pipelines_as_an_mp4(skyreels_run: Path) -> None:
    from diffusers import SkyReelsV2DiffusionForcingPipeline

    from diffpipe_core.sampling.loop import noise_generator

    folder = skyreels_run / "samples" / "step-0000000"
    assert_video_sample_point(folder, fps=24, frames=5)
    got = load_file(str(folder / "latents.safetensors"))["sample_00"]
    pipe = SkyReelsV2DiffusionForcingPipeline.from_pretrained(str(model_dir(skyreels_run)), local_files_only=True)
    (embeds,) = [runs_text(pipe, "a red cat")]
    expected = pipe(
        prompt=None, prompt_embeds=embeds, guidance_scale=1.0, generator=noise_generator(5, 0), num_inference_steps=2,
        height=32, width=32, num_frames=5, output_type="latent",
    ).frames  # fmt: skip
    torch.testing.assert_close(got.reshape(expected.shape), expected, rtol=1e-4, atol=1e-5)


def runs_text(pipe, prompt: str) -> torch.Tensor:
    """The prompt's UMT5 embeddings at the run's 8 tokens (``WanPipeline.encode_prompt``, which diffpipe caches: the
    SkyReels pipelines' own calls ftfy, not installed here)."""
    from diffusers import WanPipeline

    wan = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=None, scheduler=None)
    embeds, _ = wan.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=8)
    return embeds
