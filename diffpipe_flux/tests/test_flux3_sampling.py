"""FLUX.3 samples: the plugin's denoising hooks under the core's loop equal the modular pipeline's (``Flux3AutoBlocks``
encoding its prompt itself, without the prompt upsampler) for the same tiny model, noise and prompt, plain and with
classifier-free guidance, the decoded image included; the step-distilled flow map's equal
``Flux3DistilledAutoBlocks``' (each step's target time the next one), on the scheduler's shifted sigmas."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.testing.sampling import (
    assert_same_sample,
    float32_config,
    prompt_sample,
    registered,
    sample_latents,
)
from diffpipe_core.types import SampleRequest
from diffpipe_flux.config import Flux3Config, Flux3DistilledConfig
from diffpipe_flux.flux3 import flux3, flux3_distilled
from diffpipe_flux.testing_flux3 import modular_pipeline

PROMPT, NEGATIVE, STEPS, SEED, SIZE, LENGTH = "a red cat on a house", "blurry", 3, 5, 64, 100


def config(schema, path: Path):
    return float32_config(schema, path, text_max_length=LENGTH)


def start_noise() -> torch.Tensor:
    return torch.randn((1, 16, 4, 4), generator=noise_generator(SEED, 0))


@pytest.mark.parametrize("cfg_scale", [1.0, 3.5])
def test_sample_equals_the_modular_pipeline(tiny_flux3: Path, cfg_scale: float) -> None:
    from diffusers import ClassifierFreeGuidance

    model = registered(flux3, "flux3")
    cfg = config(Flux3Config, tiny_flux3)
    request = SampleRequest(width=SIZE, height=SIZE, steps=STEPS)
    ours = prompt_sample(model, cfg, PROMPT, NEGATIVE, request, SEED, cfg_scale)

    pipe = modular_pipeline(tiny_flux3)
    pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=cfg_scale))
    noise = start_noise()
    with torch.no_grad():
        out = pipe(prompt=PROMPT, negative_prompt=NEGATIVE if cfg_scale > 1 else None, latents=noise, height=SIZE,
                   width=SIZE, num_inference_steps=STEPS, max_sequence_length=LENGTH, output="latents")
    assert_same_sample(ours, out, noise)

    if cfg_scale == 1.0:
        from diffpipe_flux.flux2_latents import raw

        ((_, pixels),) = decode(model, cfg, {0: ours}, torch.device("cpu"))
        with torch.no_grad():
            want = pipe.vae.decode(raw(pipe.vae, out)).sample[0].clamp(-1, 1)
        assert pixels.shape == (3, SIZE, SIZE)
        torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-4)


def test_distilled_sample_equals_the_distilled_modular_pipeline(tiny_flux3_distilled: Path) -> None:
    model = registered(flux3_distilled, "flux3-distilled")
    cfg = config(Flux3DistilledConfig, tiny_flux3_distilled)
    (texts,) = encode_prompts(model, cfg, [PROMPT], None, torch.device("cpu"))
    request = SampleRequest(width=SIZE, height=SIZE, steps=STEPS)
    ours = sample_latents(model, cfg, request, texts, SEED)

    pipe = modular_pipeline(tiny_flux3_distilled, distilled=True)
    noise = start_noise()
    with torch.no_grad():
        out = pipe(prompt=PROMPT, latents=noise, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                   max_sequence_length=LENGTH, output="latents")
    assert_same_sample(ours, out, noise)
    _, sigmas = flux3_distilled.denoise_init(request, cfg, torch.Generator())
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas.float())
    assert sigmas[1] > 1 - 1 / STEPS + 0.1  # shifted by 6.93 toward noise
