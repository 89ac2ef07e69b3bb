"""HunyuanVideo samples (issue 21): the plugin's denoising hooks under the core's loop equal
``HunyuanVideoPipeline`` for the same tiny model, noise, prompt embeddings, steps and guidance (the distilled
guidance embedding, and true CFG), the decoded video included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.registry import Registry
from diffpipe_core.sampling.loop import generate, noise_generator
from diffpipe_core.sampling.pipeline import LayerChainForward
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.types import SampleRequest
from diffpipe_hunyuan.plugin import plugin as hy
from diffpipe_hunyuan.testing import tiny_config

PROMPT, STEPS, SEED, FRAMES, SIZE = "a red cat walks", 3, 5, 5, 32


config = tiny_config


@pytest.mark.parametrize("cfg_scale", [1.0, 2.0])
def test_hunyuan_sample_equals_the_pipeline(tiny_hunyuan: Path, crop_start: int, cfg_scale: float) -> None:
    from diffusers import HunyuanVideoPipeline

    registry = Registry()
    assert registry.register_model("hunyuan-video", hy).ok
    plugin = registry.model("hunyuan-video")
    assert all(plugin.has(h) for h in ("denoise_init", "denoise_inputs", "denoise_step", "load_decoder"))
    cfg = config(tiny_hunyuan, crop_start)
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], "blurry" if cfg_scale > 1 else None, torch.device("cpu"))
    model = hy.load_diffusion_model(cfg, torch.device("cpu"), torch.float32)
    forward = LayerChainForward(hy.split_into_layers(model, cfg))
    request = SampleRequest(width=SIZE, height=SIZE, frames=FRAMES, steps=STEPS, guidance=4.0)
    (ours,) = generate(plugin, cfg, request, [texts], [noise_generator(SEED, 0)], forward, cfg=cfg_scale)

    pipe = HunyuanVideoPipeline.from_pretrained(str(tiny_hunyuan), torch_dtype=torch.float32, local_files_only=True)
    noise = torch.randn((1, 4, 2, 4, 4), generator=noise_generator(SEED, 0))
    kwargs = {}
    if cfg_scale > 1:
        kwargs = {
            "negative_prompt_embeds": texts.uncond["text_embeds"],
            "negative_prompt_attention_mask": texts.uncond["text_mask"],
            "negative_pooled_prompt_embeds": texts.uncond["clip_pooled"],
            "true_cfg_scale": cfg_scale,
        }
    expected = pipe(
        prompt_embeds=texts.cond["text_embeds"],
        prompt_attention_mask=texts.cond["text_mask"],
        pooled_prompt_embeds=texts.cond["clip_pooled"],
        latents=noise,
        num_inference_steps=STEPS,
        guidance_scale=4.0,
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        output_type="latent",
        **kwargs,
    ).frames
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    assert (ours - noise).abs().max() > 0.1  # it did denoise

    ((_, pixels),) = decode(plugin, cfg, {0: ours}, torch.device("cpu"))
    with torch.no_grad():
        want = pipe.vae.decode(ours / pipe.vae.config.scaling_factor).sample[0].clamp(-1, 1)
    assert pixels.shape == (3, FRAMES, SIZE, SIZE)
    torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)
