"""AuraFlow samples: the plugin's denoising hooks under the core's loop equal ``AuraFlowPipeline`` for the same tiny
model, noise, prompt embeddings and steps, with the folder's scheduler (shift 1.73), without and with classifier-free
guidance, the decoded image included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_auraflow.plugin import plugin as aura
from diffpipe_auraflow.testing import tiny_config
from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.testing.sampling import assert_same_sample, registered, sample_latents
from diffpipe_core.types import SampleRequest

PROMPT, STEPS, SEED, SIZE = "a red cat on a tree", 3, 5, 32


@pytest.mark.parametrize("cfg_scale", [1.0, 2.0])
def test_auraflow_sample_equals_the_pipeline(tiny_auraflow: Path, cfg_scale: float) -> None:
    from diffusers import AuraFlowPipeline

    plugin = registered(aura, "auraflow")
    cfg = tiny_config(tiny_auraflow)
    negative = "blurry" if cfg_scale > 1 else None
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], negative, torch.device("cpu"))
    request = SampleRequest(width=SIZE, height=SIZE, steps=STEPS)
    ours = sample_latents(plugin, cfg, request, texts, SEED, cfg_scale)

    pipe = AuraFlowPipeline.from_pretrained(str(tiny_auraflow), dtype=torch.float32, local_files_only=True)
    assert pipe.scheduler.config.shift == 1.73
    noise = torch.randn((1, 4, 4, 4), generator=noise_generator(SEED, 0))
    ones = torch.ones(1, 16, 32)  # the pipeline wants masks beside given embeddings; the embeddings are masked already
    negative_embeds = {}
    if cfg_scale > 1:
        negative_embeds = {"negative_prompt_embeds": texts.uncond["text_embeds"],
                           "negative_prompt_attention_mask": ones}
    expected = pipe(
        prompt_embeds=texts.cond["text_embeds"], prompt_attention_mask=ones, latents=noise,
        num_inference_steps=STEPS, guidance_scale=cfg_scale, height=SIZE, width=SIZE, output_type="latent",
        max_sequence_length=16, **negative_embeds,
    ).images
    assert_same_sample(ours, expected, noise)

    ((_, pixels),) = decode(plugin, cfg, {0: ours}, torch.device("cpu"))
    with torch.no_grad():
        vae = pipe.vae
        want = vae.decode(ours / vae.config.scaling_factor).sample[0].clamp(-1, 1)
    assert pixels.shape == (3, SIZE, SIZE)
    torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)
