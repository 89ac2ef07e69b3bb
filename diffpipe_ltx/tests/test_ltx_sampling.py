"""LTX-Video samples (issue 21): the plugin's denoising hooks under the core's loop equal ``LTXPipeline`` for the
same tiny model, noise, prompt embeddings, steps and guidance (its sequence-length shift and ``shift_terminal``
schedule, with and without CFG), the decoded video included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.registry import Registry
from diffpipe_core.sampling.loop import generate, noise_generator
from diffpipe_core.sampling.pipeline import LayerChainForward
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.schema import validate
from diffpipe_core.types import SampleRequest
from diffpipe_ltx.config import LTXConfig
from diffpipe_ltx.packing import pack, unpack
from diffpipe_ltx.plugin import plugin as ltx

PROMPT, STEPS, SEED, FRAMES, WIDTH, HEIGHT = "a red car moving slowly", 3, 5, 9, 96, 64


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_ltx_sample_equals_the_pipeline(tiny_ltx: Path, cfg_scale: float) -> None:
    from diffusers import LTXPipeline

    registry = Registry()
    assert registry.register_model("ltx-video", ltx).ok
    plugin = registry.model("ltx-video")
    table = {"type": "ltx-video", "path": tiny_ltx, "dtype": "float32", "encoder_dtype": "float32"}
    cfg = validate(LTXConfig, table, "test")
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], "blurry" if cfg_scale > 1 else None, torch.device("cpu"))
    model = ltx.load_diffusion_model(cfg, torch.device("cpu"), torch.float32)
    forward = LayerChainForward(ltx.split_into_layers(model, cfg))
    request = SampleRequest(width=WIDTH, height=HEIGHT, frames=FRAMES, steps=STEPS)
    (ours,) = generate(plugin, cfg, request, [texts], [noise_generator(SEED, 0)], forward, cfg=cfg_scale)

    pipe = LTXPipeline.from_pretrained(str(tiny_ltx), torch_dtype=torch.float32, local_files_only=True)
    noise = torch.randn((1, 8, 2, 2, 3), generator=noise_generator(SEED, 0))
    kwargs = {}
    if cfg_scale > 1:
        kwargs = {
            "negative_prompt_embeds": texts.uncond["t5_embeds"],
            "negative_prompt_attention_mask": texts.uncond["t5_mask"].long(),
        }
    out = pipe(
        prompt_embeds=texts.cond["t5_embeds"],
        prompt_attention_mask=texts.cond["t5_mask"].long(),
        latents=pack(noise),
        num_inference_steps=STEPS,
        guidance_scale=cfg_scale,
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        output_type="latent",
        **kwargs,
    ).frames
    expected = unpack(out, 2, 2, 3)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    assert (ours - noise).abs().max() > 0.1  # it did denoise

    ((_, pixels),) = decode(plugin, cfg, {0: ours}, torch.device("cpu"))
    vae = pipe.vae
    with torch.no_grad():
        latents = pipe._denormalize_latents(ours, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        want = vae.decode(latents, None).sample[0].clamp(-1, 1)
    assert pixels.shape == (3, FRAMES, HEIGHT, WIDTH)
    torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)
