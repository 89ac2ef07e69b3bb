"""HunyuanVideo-1.5 samples: the plugins' denoising hooks under the core's loop equal ``HunyuanVideo15Pipeline`` and
``HunyuanVideo15ImageToVideoPipeline`` for the same tiny model, noise, prompt embeddings, steps and CFG (the
pipelines' guider), the decoded video included; the core writes it as an MP4."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.schema import validate
from diffpipe_core.testing.sampling import assert_same_sample, registered, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_hunyuan.i2v15 import plugin as i2v
from diffpipe_hunyuan.plugin15 import plugin as t2v

PROMPT, STEPS, SEED, FRAMES, SIZE, CFG = "a red cat walks", 3, 5, 5, 32, 3.0


@pytest.mark.parametrize("name", ["hunyuan-video-1.5", "hunyuan-video-1.5-i2v"])
def test_sample_equals_the_pipeline(
    name: str, tiny_hunyuan15: Path, tiny_hunyuan15_i2v: Path, crop_start15: int, tmp_path: Path
) -> None:
    import diffusers

    plugin = i2v if name.endswith("i2v") else t2v
    folder = tiny_hunyuan15_i2v if plugin is i2v else tiny_hunyuan15
    table = {"type": name, "path": folder, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 16,
             "text_crop_start": crop_start15, "glyph_max_length": 12}
    image = None
    if plugin is i2v:
        image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
        image.save(tmp_path / "first.png")
        table["sample_image"] = tmp_path / "first.png"
    cfg = validate(plugin.spec.config_schema, table, "test")
    model_plugin = registered(plugin)
    assert all(model_plugin.has(h) for h in ("denoise_init", "denoise_inputs", "denoise_step", "load_decoder"))
    (texts,) = encode_prompts(model_plugin, cfg, [PROMPT], "blurry", torch.device("cpu"))
    request = SampleRequest(width=SIZE, height=SIZE, frames=FRAMES, steps=STEPS)
    ours = sample_latents(model_plugin, cfg, request, texts, SEED, CFG)

    pipe = getattr(diffusers, plugin.pipeline_class).from_pretrained(str(folder), local_files_only=True)
    pipe.guider = pipe.guider.new(guidance_scale=CFG)
    noise = torch.randn((1, 4, 2, 2, 2), generator=noise_generator(SEED, 0))
    c, u = texts.cond, texts.uncond
    kwargs = {"image": image} if image is not None else {"height": SIZE, "width": SIZE}
    expected = pipe(
        prompt_embeds=c["text_embeds"], prompt_embeds_mask=c["text_mask"],
        prompt_embeds_2=c["glyph_embeds"], prompt_embeds_mask_2=c["glyph_mask"],
        negative_prompt_embeds=u["text_embeds"], negative_prompt_embeds_mask=u["text_mask"],
        negative_prompt_embeds_2=u["glyph_embeds"], negative_prompt_embeds_mask_2=u["glyph_mask"],
        latents=noise, num_inference_steps=STEPS, num_frames=FRAMES, output_type="latent", **kwargs,
    ).frames
    assert_same_sample(ours, expected, noise)

    ((_, pixels),) = decode(model_plugin, cfg, {0: ours}, torch.device("cpu"))
    with torch.no_grad():
        want = pipe.vae.decode(ours / pipe.vae.config.scaling_factor).sample[0].clamp(-1, 1)
    assert pixels.shape == (3, FRAMES, SIZE, SIZE)
    torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)
