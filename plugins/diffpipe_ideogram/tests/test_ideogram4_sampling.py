"""Ideogram 4 samples: the plugin's denoising hooks under the core's loop equal ``Ideogram4Pipeline``'s for the same
tiny model, noise and prompt at guidance 1 (the pipeline encoding its prompt itself, left padding and all; its
resolution-aware logit-normal schedule), the decoded image included, and equal the modular pipeline's
(``Ideogram4AutoBlocks``, its text-encoding block included); a sample's noise is the pipeline's own draw for the seed;
``cfg > 1`` is plain CFG through the trained transformer, with a warning that it is not the pipeline's guidance (which
runs its second transformer)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.schema import validate
from diffpipe_core.testing.sampling import assert_same_sample, registered, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_ideogram.config import Ideogram4Config
from diffpipe_ideogram.plugin import plugin, tokens, unpatchify, untokens
from diffpipe_ideogram.testing import load_pipeline

PROMPT, STEPS, SEED, SIZE, LENGTH = "a red cat on a house", 3, 5, 64, 32
REQUEST = SampleRequest(width=SIZE, height=SIZE, steps=STEPS)


def config(path: Path):
    table = {"type": "ideogram4", "path": path, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": LENGTH}
    return validate(Ideogram4Config, table, "test")


def test_sample_equals_the_pipeline_and_the_modular_pipeline(tiny_ideogram4: Path) -> None:
    from diffusers.modular_pipelines import Ideogram4AutoBlocks

    model = registered(plugin, "ideogram4")
    cfg = config(tiny_ideogram4)
    (texts,) = encode_prompts(model, cfg, [PROMPT], None, torch.device("cpu"))
    ours = sample_latents(model, cfg, REQUEST, texts, SEED)
    noise, _ = plugin.denoise_init(REQUEST, cfg, noise_generator(SEED, 0))

    pipe = load_pipeline(tiny_ideogram4)
    call = {"height": SIZE, "width": SIZE, "num_inference_steps": STEPS, "max_sequence_length": LENGTH}
    with torch.no_grad():  # the pipeline's own noise for the seed: the tokens the plugin's noise holds
        out = pipe(prompt=PROMPT, guidance_scale=1.0, guidance_schedule=None, output_type="latent",
                   generator=noise_generator(SEED, 0), **call).images
    assert_same_sample(ours, untokens(out, 4, 4), noise)

    blocks = Ideogram4AutoBlocks().init_pipeline()
    blocks.update_components(**{n: getattr(pipe, n) for n in ("transformer", "unconditional_transformer", "vae",
                                                              "text_encoder", "tokenizer", "scheduler")})
    with torch.no_grad():
        modular = blocks(prompt=PROMPT, latents=tokens(noise), guidance_schedule=[1.0] * STEPS, output="latents",
                         **call)
    assert_same_sample(unpatchify(ours), modular, unpatchify(noise))

    ((_, pixels),) = decode(model, cfg, {0: ours}, torch.device("cpu"))
    with torch.no_grad():
        image = pipe(prompt=PROMPT, guidance_scale=1.0, guidance_schedule=None, output_type="pt",
                     latents=tokens(noise), **call).images[0]
    assert pixels.shape == (3, SIZE, SIZE)
    torch.testing.assert_close(pixels / 2 + 0.5, image, rtol=1e-4, atol=1e-5)


def test_guidance_is_plain_cfg_and_said(tiny_ideogram4: Path, caplog: pytest.LogCaptureFixture) -> None:
    cond, uncond = torch.tensor([2.0]), torch.tensor([1.0])
    plugin.__dict__.pop("_warned_cfg", None)  # said once per process: the kit's CFG sample may have said it
    with caplog.at_level("WARNING", logger="diffpipe.ideogram"):
        got = plugin.combine_guidance(uncond=uncond, cond=cond, scale=3.0, schedule=torch.zeros(2), index=0,
                                      model_config=config(tiny_ideogram4))
    assert got.tolist() == [4.0]
    assert "not Ideogram4Pipeline's guidance, which runs the folder's unconditional_transformer" in caplog.text
