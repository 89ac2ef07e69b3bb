"""Z-Image samples: the plugin's denoising hooks under the core's loop equal ``ZImagePipeline`` for the same tiny
model, noise, prompt embeddings and steps, without and with classifier-free guidance (the pipeline's
``guidance_scale`` s is diffpipe's ``cfg`` s + 1: it computes ``cond + s (cond - uncond)``), the decoded image
included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.testing.sampling import assert_same_sample, registered, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_zimage.plugin import plugin as zi
from diffpipe_zimage.testing import tiny_config

PROMPT, STEPS, SEED, SIZE = "a red cat on a tree", 3, 5, 32


def real_tokens(text: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [e[m.bool()] for e, m in zip(text["text_embeds"], text["text_mask"], strict=True)]


@pytest.mark.parametrize("cfg_scale", [1.0, 2.0])
def test_zimage_sample_equals_the_pipeline(tiny_zimage: Path, cfg_scale: float) -> None:
    from diffusers import ZImagePipeline

    plugin = registered(zi, "z-image")
    assert all(plugin.has(h) for h in ("denoise_init", "denoise_inputs", "denoise_step", "load_decoder"))
    cfg = tiny_config(tiny_zimage)
    negative = "blurry" if cfg_scale > 1 else None
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], negative, torch.device("cpu"))
    request = SampleRequest(width=SIZE, height=SIZE, steps=STEPS)
    ours = sample_latents(plugin, cfg, request, texts, SEED, cfg_scale)

    pipe = ZImagePipeline.from_pretrained(str(tiny_zimage), dtype=torch.float32, local_files_only=True)
    noise = torch.randn((1, 4, 4, 4), generator=noise_generator(SEED, 0))
    kwargs = {"negative_prompt_embeds": real_tokens(texts.uncond)} if cfg_scale > 1 else {}
    expected = pipe(
        prompt_embeds=real_tokens(texts.cond),
        latents=noise,
        num_inference_steps=STEPS,
        guidance_scale=cfg_scale - 1,
        height=SIZE,
        width=SIZE,
        output_type="latent",
        **kwargs,
    ).images
    assert_same_sample(ours, expected, noise)

    ((_, pixels),) = decode(plugin, cfg, {0: ours}, torch.device("cpu"))
    with torch.no_grad():
        vae = pipe.vae
        want = vae.decode(ours / vae.config.scaling_factor + vae.config.shift_factor).sample[0].clamp(-1, 1)
    assert pixels.shape == (3, SIZE, SIZE)
    torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)
