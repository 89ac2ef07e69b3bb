"""Qwen-Image 2.1 samples: the plugin's denoising hooks under the core's loop equal ``QwenImage21Pipeline`` for the
same tiny model, noise, prompt embeddings and steps (plain, and with CFG), the decoded image included; the Turbo
checkpoint's samples equal ``QwenImage21TurboModularPipeline``'s on the folder's own ``sample_sigmas``."""

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
    registered,
    sample_latents,
)
from diffpipe_core.types import SampleRequest
from diffpipe_qwenimage.config import QwenImage21Config, QwenImage21TurboConfig
from diffpipe_qwenimage.qwen21 import flat, plugin, turbo
from diffpipe_qwenimage.testing21 import TURBO_SIGMAS, load_pipeline

PROMPT, NEGATIVE, STEPS, SEED, SIZE = "a red cat on a house", "blurry", 3, 5, 64


def embeds(text: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A cached prompt cut to its own length, as ``encode_prompt`` returns one prompt."""
    n = int(text["text_mask"].sum())
    return text["text_embeds"][:, :n], text["text_mask"][:, :n].bool()


def config(schema, path: Path):
    return float32_config(schema, path, text_max_length=32)


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_sample_equals_the_pipeline(tiny_qwen21: Path, cfg_scale: float) -> None:
    model = registered(plugin, "qwen-image-2.1")
    cfg = config(QwenImage21Config, tiny_qwen21)
    (texts,) = encode_prompts(model, cfg, [PROMPT], NEGATIVE if cfg_scale > 1 else None, torch.device("cpu"))
    ours = sample_latents(model, cfg, SampleRequest(width=SIZE, height=SIZE, steps=STEPS), texts, SEED, cfg_scale)

    pipe = load_pipeline(tiny_qwen21)
    noise = torch.randn((1, 1, 4, 4, 4), generator=noise_generator(SEED, 0))[:, 0]
    prompt, _ = embeds(texts.cond)
    kwargs = {"prompt_embeds": prompt, "num_inference_steps": STEPS, "height": SIZE, "width": SIZE,
              "output_type": "latent"}
    if cfg_scale > 1:
        kwargs.update(negative_prompt_embeds=embeds(texts.uncond)[0], true_cfg_scale=cfg_scale)
    for kv_cache in (False, True):  # the cache recomputes only the target's rows: the same function
        out = pipe(latents=flat(noise), use_kv_cache=kv_cache, **kwargs).images
        assert_same_sample(ours, out.transpose(1, 2).reshape(1, 4, 4, 4), noise)

    ((_, pixels),) = decode(model, cfg, {0: ours}, torch.device("cpu"))
    with torch.no_grad():
        z = ours.unsqueeze(2) * torch.tensor(pipe.vae.config.latents_std).view(1, 4, 1, 1, 1)
        z = z + torch.tensor(pipe.vae.config.latents_mean).view(1, 4, 1, 1, 1)
        want = pipe.vae.decode(z).sample[0, :3, 0].clamp(-1, 1)  # the VAE decodes RGBA
    assert pixels.shape == (3, SIZE, SIZE)
    torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)


def test_turbo_sample_equals_the_turbo_modular_pipeline(tiny_qwen21_turbo: Path) -> None:
    from diffusers.modular_pipelines import QwenImage21TurboAutoBlocks

    model = registered(turbo, "qwen-image-2.1-turbo")
    cfg = config(QwenImage21TurboConfig, tiny_qwen21_turbo)
    (texts,) = encode_prompts(model, cfg, [PROMPT], None, torch.device("cpu"))
    # the request's steps give way to the folder's sample_sigmas, as the pipelines' num_inference_steps do
    ours = sample_latents(model, cfg, SampleRequest(width=SIZE, height=SIZE, steps=20), texts, SEED)

    base = load_pipeline(tiny_qwen21_turbo)
    pipe = QwenImage21TurboAutoBlocks().init_pipeline()
    parts = {name: getattr(base, name) for name in ("transformer", "vae", "text_encoder", "processor", "scheduler")}
    pipe.update_components(**parts, sample_sigmas=TURBO_SIGMAS)
    noise = torch.randn((1, 1, 4, 4, 4), generator=noise_generator(SEED, 0))[:, 0]
    with torch.no_grad():
        out = pipe(prompt=PROMPT, latents=flat(noise), height=SIZE, width=SIZE, output="latents")
    assert_same_sample(ours, out[:, :, 0], noise)
    assert len(base.scheduler.sigmas) == len(TURBO_SIGMAS) + 1  # it ran the folder's grid, not 20 steps
