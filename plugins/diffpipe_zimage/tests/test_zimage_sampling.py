"""Z-Image samples: the plugin's denoising hooks under the core's loop equal ``ZImagePipeline`` for the same tiny
model, noise, prompt embeddings and steps, without and with classifier-free guidance (the pipeline's
``guidance_scale`` s is diffpipe's ``cfg`` s + 1: it computes ``cond + s (cond - uncond)``), the decoded image
included."""

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
from diffpipe_zimage.config import ZImageConfig
from diffpipe_zimage.plugin import plugin as zi

PROMPT, STEPS, SEED, SIZE = "a red cat on a tree", 3, 5, 32


def real_tokens(text: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [e[m.bool()] for e, m in zip(text["text_embeds"], text["text_mask"], strict=True)]


@pytest.mark.parametrize("cfg_scale", [1.0, 2.0])
def test_zimage_sample_equals_the_pipeline(tiny_zimage: Path, cfg_scale: float) -> None:
    from diffusers import ZImagePipeline

    registry = Registry()
    assert registry.register_model("z-image", zi).ok
    plugin = registry.model("z-image")
    assert all(plugin.has(h) for h in ("denoise_init", "denoise_inputs", "denoise_step", "load_decoder"))
    table = {"type": "z-image", "path": tiny_zimage, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": 40}
    cfg = validate(ZImageConfig, table, "test")
    negative = "blurry" if cfg_scale > 1 else None
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], negative, torch.device("cpu"))
    model = zi.load_diffusion_model(cfg, torch.device("cpu"), torch.float32)
    forward = LayerChainForward(zi.split_into_layers(model, cfg))
    request = SampleRequest(width=SIZE, height=SIZE, steps=STEPS)
    (ours,) = generate(plugin, cfg, request, [texts], [noise_generator(SEED, 0)], forward, cfg=cfg_scale)

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
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    assert (ours - noise).abs().max() > 0.1  # it did denoise

    ((_, pixels),) = decode(plugin, cfg, {0: ours}, torch.device("cpu"))
    with torch.no_grad():
        vae = pipe.vae
        want = vae.decode(ours / vae.config.scaling_factor + vae.config.shift_factor).sample[0].clamp(-1, 1)
    assert pixels.shape == (3, SIZE, SIZE)
    torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)
