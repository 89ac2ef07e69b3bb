"""Krea 2 samples: the plugin's denoising hooks under the core's loop equal ``Krea2Pipeline`` for the same tiny model,
noise and prompt (the pipeline encoding its prompt itself, middle padding and all; plain, and with CFG at ``cfg = 1 +
guidance_scale``), the decoded image included; the Turbo checkpoint's samples equal ``Krea2TurboModularPipeline``'s
(its text-encoding blocks included), at the distilled shift."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.parts.latents import pack_2x2, unpack_2x2
from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.runner import decode
from diffpipe_core.testing.sampling import (
    assert_same_sample,
    float32_config,
    prompt_sample,
    registered,
)
from diffpipe_core.types import SampleRequest
from diffpipe_krea.config import Krea2Config, Krea2TurboConfig
from diffpipe_krea.plugin import plugin, turbo
from diffpipe_krea.testing import load_pipeline

PROMPT, NEGATIVE, STEPS, SEED, SIZE, LENGTH = "a red cat on a house", "blurry", 3, 5, 64, 24


def config(schema, path: Path):
    return float32_config(schema, path, text_max_length=LENGTH)


def start_noise() -> torch.Tensor:
    return torch.randn((1, 4, 8, 8), generator=noise_generator(SEED, 0))


@pytest.mark.parametrize("cfg_scale", [1.0, 3.5])
def test_sample_equals_the_pipeline(tiny_krea2: Path, cfg_scale: float) -> None:
    model = registered(plugin, "krea2")
    cfg = config(Krea2Config, tiny_krea2)
    request = SampleRequest(width=SIZE, height=SIZE, steps=STEPS)
    ours = prompt_sample(model, cfg, PROMPT, NEGATIVE, request, SEED, cfg_scale)

    pipe = load_pipeline(tiny_krea2)
    noise = start_noise()
    with torch.no_grad():  # Krea's guidance_scale g: cond + g * (cond - uncond), CFG at 1 + g; g = 0 is none
        out = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, guidance_scale=cfg_scale - 1, latents=pack_2x2(noise),
                   num_inference_steps=STEPS, height=SIZE, width=SIZE, max_sequence_length=LENGTH,
                   output_type="latent").images
    assert_same_sample(ours, unpack_2x2(out, 8, 8), noise)

    if cfg_scale == 1.0:
        ((_, pixels),) = decode(model, cfg, {0: ours}, torch.device("cpu"))
        with torch.no_grad():
            z = ours.unsqueeze(2) * torch.tensor(pipe.vae.config.latents_std).view(1, 4, 1, 1, 1)
            z = z + torch.tensor(pipe.vae.config.latents_mean).view(1, 4, 1, 1, 1)
            want = pipe.vae.decode(z).sample[0, :, 0].clamp(-1, 1)
        assert pixels.shape == (3, SIZE, SIZE)
        torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)


def test_turbo_sample_equals_the_turbo_modular_pipeline(tiny_krea2: Path) -> None:
    from diffusers.modular_pipelines import Krea2TurboAutoBlocks

    model = registered(turbo, "krea2-turbo")
    cfg = config(Krea2TurboConfig, tiny_krea2)  # Raw's folder: the Turbo entry point's shift all the same
    request = SampleRequest(width=SIZE, height=SIZE, steps=STEPS)
    ours = prompt_sample(model, cfg, PROMPT, None, request, SEED)

    base = load_pipeline(tiny_krea2)
    pipe = Krea2TurboAutoBlocks().init_pipeline()
    pipe.update_components(**{n: getattr(base, n) for n in ("transformer", "vae", "text_encoder", "tokenizer",
                                                            "scheduler")})
    noise = start_noise()
    with torch.no_grad():
        out = pipe(prompt=PROMPT, latents=pack_2x2(noise), height=SIZE, width=SIZE, num_inference_steps=STEPS,
                   max_sequence_length=LENGTH, output="latents")
    assert_same_sample(ours, out[:, :, 0], noise)
    # the distilled shift (mu = 1.15), not Raw's for 16 image tokens: the Turbo entry point's own schedule
    assert not torch.allclose(sigmas_of(turbo, cfg), sigmas_of(plugin, cfg))
    torch.testing.assert_close(sigmas_of(turbo, cfg), base.scheduler.sigmas.float())


def sigmas_of(model, cfg) -> torch.Tensor:
    _, sigmas = model.denoise_init(SampleRequest(width=SIZE, height=SIZE, steps=STEPS), cfg, torch.Generator())
    return sigmas
