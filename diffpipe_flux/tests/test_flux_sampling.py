"""Flux samples (issue 14): the plugin's denoising hooks under the core's loop equal ``FluxPipeline`` for the
same tiny model, noise, prompt embeddings, steps and guidance (with and without true CFG), decoded images
included; and the shared 2-stage training run writes its samples at the configured steps, the first of them
equal to ``FluxPipeline``'s (so the pipeline engine computes what the model computes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from diffpipe_core.registry import get_registry
from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.testing.sampling import assert_same_sample, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_flux.config import FluxConfig
from diffpipe_flux.testing import pipeline_latents

PROMPT = "a red cat"
STEPS, SEED = 3, 5


def flux_config(path: Path) -> FluxConfig:
    return FluxConfig(type="flux", path=path, dtype="float32", encoder_dtype="float32", t5_max_length=16)


def fluxpipeline_latents(path: Path, texts, cfg_scale: float = 1.0) -> torch.Tensor:
    """FluxPipeline's final latents (unpacked) from the same noise and prompt embeddings."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(path), torch_dtype=torch.float32, local_files_only=True)
    noise = torch.randn((1, 4, 8, 8), generator=noise_generator(SEED, 0))
    return pipeline_latents(pipe, texts, noise, STEPS, cfg_scale)


@pytest.mark.parametrize("cfg_scale", [1.0, 2.5])
def test_flux_sample_equals_fluxpipeline(tiny_flux: Path, cfg_scale: float) -> None:
    from diffusers import AutoencoderKL

    plugin = get_registry().model("flux")
    cfg = flux_config(tiny_flux)
    negative = "blurry" if cfg_scale > 1 else None
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], negative, torch.device("cpu"))
    request = SampleRequest(width=64, height=64, steps=STEPS)
    ours = sample_latents(plugin, cfg, request, texts, SEED, cfg_scale)
    noise = torch.randn((1, 4, 8, 8), generator=noise_generator(SEED, 0))
    assert_same_sample(ours, fluxpipeline_latents(tiny_flux, texts, cfg_scale), noise)

    # decoding as FluxPipeline does: (latents / scaling + shift) through the VAE
    ((_, pixels),) = decode(plugin, cfg, {0: ours}, torch.device("cpu"))
    vae = AutoencoderKL.from_pretrained(str(tiny_flux / "vae"), local_files_only=True)
    with torch.no_grad():
        want = vae.decode(ours / vae.config.scaling_factor + vae.config.shift_factor).sample[0].clamp(-1, 1)
    assert pixels.shape == (3, 64, 64)
    torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_flux_samples_during_a_two_stage_run(flux_two_stages: Path) -> None:
    """The shared 2-stage run (24 steps, see conftest.py) samples before its first step and every 12 steps."""
    run = flux_two_stages
    folders = sorted(p.name for p in (run / "samples").iterdir())
    assert folders == ["step-0000000", "step-0000012", "step-0000024"]
    for name in folders:
        files = sorted(p.name for p in (run / "samples" / name).iterdir())
        assert files == ["00-a-red-cat.png", "contact-sheet.png", "latents.safetensors", "prompts.json"], files
        with Image.open(run / "samples" / name / "00-a-red-cat.png") as im:
            assert im.size == (64, 64) and im.mode == "RGB"
    first, last = (np.asarray(Image.open(run / "samples" / f / "00-a-red-cat.png")) for f in (folders[0], folders[-1]))
    assert not np.array_equal(first, last)  # the LoRA trained between them

    # step 0 (LoRA B = 0): the 2-stage pipeline's sample is FluxPipeline's for the base model
    model_dir = run.parent.parent / "model"
    plugin = get_registry().model("flux")
    (texts,) = encode_prompts(plugin, flux_config(model_dir), [PROMPT], None, torch.device("cpu"))
    got = load_file(str(run / "samples" / "step-0000000" / "latents.safetensors"))["sample_00"]
    torch.testing.assert_close(got, fluxpipeline_latents(model_dir, texts), rtol=1e-4, atol=1e-5)
