"""SDXL samples (issue 21): the plugin's denoising hooks under the core's loop equal ``StableDiffusionXLPipeline`` for
the same tiny model, noise, prompt embeddings, steps and guidance (epsilon and v-prediction, with and without
classifier-free guidance, long-prompt chunks masked), decoded images included; and the shared 2-stage training run
writes its samples at the configured steps, the first of them equal to the pipeline's (so the pipeline engine, on
the single-file checkpoint, computes what the model computes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from diffpipe_core.registry import get_registry
from diffpipe_core.sampling.loop import generate, noise_generator
from diffpipe_core.sampling.pipeline import LayerChainForward
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.types import SampleRequest
from diffpipe_sdxl.config import SDXLConfig

PROMPT = "a red cat"
STEPS, SEED = 3, 5


def sdxl_config(folder: Path, **kw: object) -> SDXLConfig:
    return SDXLConfig(type="sdxl", path=folder, dtype="float32", **kw)


def pipeline_latents(folder: Path, texts, cfg_scale: float = 1.0, v_pred: bool = False) -> torch.Tensor:
    """StableDiffusionXLPipeline's final latents from the same noise and prompt embeddings (their valid chunk)."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(str(folder), torch_dtype=torch.float32, local_files_only=True)
    if v_pred:
        pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config, prediction_type="v_prediction")
    noise = torch.randn((1, 4, 8, 8), generator=noise_generator(SEED, 0))  # the pipeline scales it itself
    kwargs = {}
    if cfg_scale > 1:
        kwargs = {
            "negative_prompt_embeds": texts.uncond["text_embeds"][:, :77],
            "negative_pooled_prompt_embeds": texts.uncond["pooled"],
        }
    return pipe(
        prompt_embeds=texts.cond["text_embeds"][:, :77],
        pooled_prompt_embeds=texts.cond["pooled"],
        latents=noise,
        num_inference_steps=STEPS,
        guidance_scale=cfg_scale,
        height=64,
        width=64,
        output_type="latent",
        **kwargs,
    ).images


@pytest.mark.parametrize(("v_pred", "cfg_scale"), [(False, 1.0), (False, 5.0), (True, 5.0)])
def test_sdxl_sample_equals_the_pipeline(tiny_sdxl: tuple[Path, Path], v_pred: bool, cfg_scale: float) -> None:
    from diffusers import AutoencoderKL

    folder = tiny_sdxl[0]
    plugin = get_registry().model("sdxl")
    cfg = sdxl_config(folder, v_pred=v_pred)
    negative = "blurry" if cfg_scale > 1 else None
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], negative, torch.device("cpu"))
    assert texts.cond["text_mask"].shape == (1, 3 * 77) and not texts.cond["text_mask"][0, 77:].any()
    model = plugin.require("load_diffusion_model", model_config=cfg, device=torch.device("cpu"), dtype=torch.float32)
    forward = LayerChainForward(plugin.require("split_into_layers", model=model, model_config=cfg))
    request = SampleRequest(width=64, height=64, steps=STEPS)
    (ours,) = generate(plugin, cfg, request, [texts], [noise_generator(SEED, 0)], forward, cfg=cfg_scale)
    expected = pipeline_latents(folder, texts, cfg_scale, v_pred)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    noise = torch.randn((1, 4, 8, 8), generator=noise_generator(SEED, 0))
    assert (ours - noise).abs().max() > 0.1  # it did denoise

    if cfg_scale == 1.0:  # decoding as the pipeline does: latents / scaling_factor through the VAE
        ((_, pixels),) = decode(plugin, cfg, {0: ours}, torch.device("cpu"))
        vae = AutoencoderKL.from_pretrained(str(folder / "vae"), local_files_only=True)
        with torch.no_grad():
            want = vae.decode(ours / vae.config.scaling_factor).sample[0].clamp(-1, 1)
        assert pixels.shape == (3, 64, 64)
        torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_sdxl_samples_during_a_two_stage_run(sdxl_two_stages: Path, tiny_sdxl: tuple[Path, Path]) -> None:
    """The shared golden 2-stage run (single file, see conftest.py) samples before its first step and at step 4."""
    run = sdxl_two_stages
    folders = sorted(p.name for p in (run / "samples").iterdir())
    assert folders == ["step-0000000", "step-0000004"]
    for name in folders:
        files = sorted(p.name for p in (run / "samples" / name).iterdir())
        assert files == ["00-a-red-cat.png", "contact-sheet.png", "latents.safetensors", "prompts.json"], files
        with Image.open(run / "samples" / name / "00-a-red-cat.png") as im:
            assert im.size == (64, 64) and im.mode == "RGB"
    first, last = (load_file(str(run / "samples" / f / "latents.safetensors"))["sample_00"] for f in folders)
    assert not torch.equal(first, last)  # the LoRA trained between them

    # step 0 (LoRA B = 0): the 2-stage pipeline's sample is StableDiffusionXLPipeline's for the base model
    folder = tiny_sdxl[0]
    cfg = sdxl_config(folder, max_prompt_chunks=2)
    (texts,) = encode_prompts(get_registry().model("sdxl"), cfg, [PROMPT], None, torch.device("cpu"))
    torch.testing.assert_close(first, pipeline_latents(folder, texts), rtol=1e-4, atol=1e-5)
