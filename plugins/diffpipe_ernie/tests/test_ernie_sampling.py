"""ERNIE-Image samples: the plugin's denoising hooks under the core's loop equal ``ErnieImagePipeline`` for the same
tiny model, noise, prompt embeddings and steps with the folder's own scheduler (shift 3), with classifier-free
guidance (the pipeline's ``guidance_scale`` is diffpipe's ``cfg``), and the decoded image equals the pipeline's
decoding (batch-norm un-normalisation, unpatchify, VAE)."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.testing.sampling import assert_same_sample, registered, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_ernie.plugin import plugin as ernie
from diffpipe_ernie.testing import tiny_config

PROMPT, NEGATIVE, STEPS, SEED, SIZE, CFG = "a red cat on a tree", "blurry", 3, 5, 32, 3.0


def real_tokens(text: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [e[m.bool()] for e, m in zip(text["text_embeds"], text["text_mask"], strict=True)]


def test_ernie_sample_and_its_image_equal_the_pipeline(tiny_ernie: Path) -> None:
    from diffusers import ErnieImagePipeline

    plugin = registered(ernie, "ernie-image")
    cfg = tiny_config(tiny_ernie)
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], NEGATIVE, torch.device("cpu"))
    request = SampleRequest(width=SIZE, height=SIZE, steps=STEPS)
    ours = sample_latents(plugin, cfg, request, texts, SEED, CFG)

    pipe = ErnieImagePipeline.from_pretrained(str(tiny_ernie), dtype=torch.float32, local_files_only=True)
    noise = torch.randn((1, 16, SIZE // 4, SIZE // 4), generator=noise_generator(SEED, 0))
    expected = pipe(prompt_embeds=real_tokens(texts.cond), negative_prompt_embeds=real_tokens(texts.uncond),
                    latents=noise, num_inference_steps=STEPS, guidance_scale=CFG, height=SIZE, width=SIZE,
                    output_type="latent").images
    assert pipe.scheduler.config.shift == 3.0 and not pipe.scheduler.config.use_dynamic_shifting
    assert_same_sample(ours, expected, noise)

    ((_, pixels),) = decode(plugin, cfg, {0: ours}, torch.device("cpu"))
    want = pipe(prompt_embeds=real_tokens(texts.cond), negative_prompt_embeds=real_tokens(texts.uncond),
                latents=noise, num_inference_steps=STEPS, guidance_scale=CFG, height=SIZE, width=SIZE,
                output_type="pt").images[0]
    assert pixels.shape == (3, SIZE, SIZE)
    torch.testing.assert_close((pixels + 1) / 2, want, rtol=1e-4, atol=1e-4)
