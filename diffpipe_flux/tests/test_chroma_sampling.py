"""Chroma samples: the plugin's denoising hooks under the core's loop equal ``ChromaPipeline`` for the same tiny
model, noise, prompt embeddings and masks, and steps, without and with (true) CFG, decoded images included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.registry import get_registry
from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.schema import validate
from diffpipe_core.testing.sampling import sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_flux.config import ChromaConfig
from diffpipe_flux.packing import pack, unpack

PROMPT, SEED = "a red cat", 5


def chroma_config(path: Path) -> ChromaConfig:
    table = {"type": "chroma", "path": path, "dtype": "float32", "encoder_dtype": "float32", "t5_max_length": 8}
    return validate(ChromaConfig, table, "test")


def encoded(path: Path, prompt: str, negative: str | None):
    plugin = get_registry().model("chroma")
    (texts,) = encode_prompts(plugin, chroma_config(path), [prompt], negative, torch.device("cpu"))
    return texts


def chromapipeline_latents(path: Path, texts, cfg_scale: float, size: int, steps: int) -> torch.Tensor:
    """ChromaPipeline's final latents (unpacked) from the same noise, prompt embeddings and masks."""
    from diffusers import ChromaPipeline

    pipe = ChromaPipeline.from_pretrained(str(path), torch_dtype=torch.float32, local_files_only=True)
    n = size // 8
    noise = torch.randn((1, 4, n, n), generator=noise_generator(SEED, 0))
    kwargs = {}
    if cfg_scale > 1:
        kwargs = {
            "negative_prompt_embeds": texts.uncond["t5_embeds"],
            "negative_prompt_attention_mask": texts.uncond["t5_mask"].float(),
        }
    out = pipe(
        prompt_embeds=texts.cond["t5_embeds"],
        prompt_attention_mask=texts.cond["t5_mask"].float(),
        latents=pack(noise),
        num_inference_steps=steps,
        guidance_scale=cfg_scale,
        height=size,
        width=size,
        output_type="latent",
        **kwargs,
    ).images
    return unpack(out, n, n)


@pytest.mark.parametrize("cfg_scale", [4.0])  # without CFG: the shared run's first sample (test_chroma_train)
def test_chroma_sample_equals_chromapipeline(tiny_chroma: Path, cfg_scale: float) -> None:
    from diffusers import AutoencoderKL

    plugin = get_registry().model("chroma")
    cfg = chroma_config(tiny_chroma)
    texts = encoded(tiny_chroma, PROMPT, "blurry" if cfg_scale > 1 else None)
    request = SampleRequest(width=32, height=32, steps=3)
    ours = sample_latents(plugin, cfg, request, texts, SEED, cfg_scale)
    torch.testing.assert_close(ours, chromapipeline_latents(tiny_chroma, texts, cfg_scale, 32, 3), rtol=1e-4, atol=1e-5)
    assert (ours - torch.randn((1, 4, 4, 4), generator=noise_generator(SEED, 0))).abs().max() > 0.1  # it denoised

    ((_, pixels),) = decode(plugin, cfg, {0: ours}, torch.device("cpu"))
    vae = AutoencoderKL.from_pretrained(str(tiny_chroma / "vae"), local_files_only=True)
    with torch.no_grad():
        want = vae.decode(ours / vae.config.scaling_factor + vae.config.shift_factor).sample[0].clamp(-1, 1)
    torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)
