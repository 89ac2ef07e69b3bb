"""SD3 samples: the plugin's denoising hooks under the core's loop equal ``StableDiffusion3Pipeline`` for the same
tiny model, noise, prompt embeddings and steps, with the folder's scheduler (shift 3), without and with
classifier-free guidance, the decoded image included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.testing.sampling import assert_same_sample, registered, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_sd3.plugin import plugin as sd3
from diffpipe_sd3.testing import tiny_config

PROMPT, STEPS, SEED, SIZE = "a red cat on a tree", 3, 5, 32


@pytest.mark.parametrize("cfg_scale", [1.0, 2.0])
def test_sd3_sample_equals_the_pipeline(tiny_sd3: Path, cfg_scale: float) -> None:
    from diffusers import StableDiffusion3Pipeline

    plugin = registered(sd3, "sd3")
    cfg = tiny_config(tiny_sd3)
    negative = "blurry" if cfg_scale > 1 else None
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], negative, torch.device("cpu"))
    request = SampleRequest(width=SIZE, height=SIZE, steps=STEPS)
    ours = sample_latents(plugin, cfg, request, texts, SEED, cfg_scale)

    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3), dtype=torch.float32, local_files_only=True)
    assert pipe.scheduler.config.shift == 3.0
    noise = torch.randn((1, 4, 4, 4), generator=noise_generator(SEED, 0))
    negative_embeds = {}
    if cfg_scale > 1:
        negative_embeds = {"negative_prompt_embeds": texts.uncond["text_embeds"],
                           "negative_pooled_prompt_embeds": texts.uncond["pooled"]}
    expected = pipe(
        prompt_embeds=texts.cond["text_embeds"], pooled_prompt_embeds=texts.cond["pooled"], latents=noise,
        num_inference_steps=STEPS, guidance_scale=cfg_scale, height=SIZE, width=SIZE, output_type="latent",
        **negative_embeds,
    ).images
    assert_same_sample(ours, expected, noise)

    ((_, pixels),) = decode(plugin, cfg, {0: ours}, torch.device("cpu"))
    with torch.no_grad():
        vae = pipe.vae
        want = vae.decode(ours / vae.config.scaling_factor + vae.config.shift_factor).sample[0].clamp(-1, 1)
    assert pixels.shape == (3, SIZE, SIZE)
    torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)
