"""Lumina 2 samples: the plugin's denoising hooks under the core's loop equal ``Lumina2Pipeline`` called with the
prompt and negative prompt strings (the system prompt before the prompt only, as the pipeline encodes them), the same
tiny model, noise and steps and the folder's scheduler: without guidance, and with guidance truncated after half the
steps without renormalisation (the conformance kit compares guidance with the pipeline's default renormalisation);
the decoded image included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.testing.sampling import assert_same_sample, registered, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_lumina.plugin import plugin as lumina
from diffpipe_lumina.testing import tiny_config

PROMPT, NEGATIVE, STEPS, SEED, SIZE = "a red cat on a tree", "blurry", 3, 5, 32


@pytest.mark.parametrize(
    ("cfg_scale", "keys"),
    [(1.0, {}), (3.0, {"cfg_trunc_ratio": 0.5, "cfg_normalization": False})],
    ids=["no-guidance", "guidance-truncated"],
)
def test_lumina2_sample_equals_the_pipeline(tiny_lumina2: Path, cfg_scale: float, keys: dict) -> None:
    from diffusers import Lumina2Pipeline

    plugin = registered(lumina, "lumina2")
    cfg = tiny_config(tiny_lumina2, **keys)
    negative = NEGATIVE if cfg_scale > 1 else None
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], negative, torch.device("cpu"))
    request = SampleRequest(width=SIZE, height=SIZE, steps=STEPS)
    ours = sample_latents(plugin, cfg, request, texts, SEED, cfg_scale)

    pipe = Lumina2Pipeline.from_pretrained(str(tiny_lumina2), dtype=torch.float32, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.scheduler.config.shift == 6.0
    noise = torch.randn((1, 4, 4, 4), generator=noise_generator(SEED, 0))
    expected = pipe(
        PROMPT, negative_prompt=negative, latents=noise.clone(), num_inference_steps=STEPS, guidance_scale=cfg_scale,
        height=SIZE, width=SIZE, output_type="latent", max_sequence_length=48,
        cfg_trunc_ratio=cfg.cfg_trunc_ratio, cfg_normalization=cfg.cfg_normalization,
    ).images
    assert_same_sample(ours, expected, noise)

    ((_, pixels),) = decode(plugin, cfg, {0: ours}, torch.device("cpu"))
    with torch.no_grad():
        vae = pipe.vae
        want = vae.decode(ours / vae.config.scaling_factor + vae.config.shift_factor).sample[0].clamp(-1, 1)
    assert pixels.shape == (3, SIZE, SIZE)
    torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)
