"""FLUX.3's cached text is what the modular pipeline's text block (``Flux3TextEncoderStep``) computes for each caption:
its chat template, its window (the caption's tokens rounded up to a multiple of 80, capped at max_sequence_length),
the eight tapped Qwen3-VL layers stacked; the latents are the pipeline's VAE encoder step's (patchified, batch-norm
normalised)."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.schema import validate
from diffpipe_core.types import EncodeBatch
from diffpipe_flux.config import Flux3Config
from diffpipe_flux.flux3 import flux3
from diffpipe_flux.testing_flux3 import load_components

CPU = torch.device("cpu")
LENGTH = 100
CAPTIONS = ["a red cat on the house", " ".join(["a photo of a small dog"] * 20), ""]


def cfg_of(path: Path):
    table = {"type": "flux3", "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": LENGTH}
    return validate(Flux3Config, table, "test")


def test_captions_equal_the_text_block(tiny_flux3: Path) -> None:
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

    enc = flux3.load_encoders(cfg_of(tiny_flux3), CPU)
    out = flux3.encode_batch(enc, EncodeBatch(captions=CAPTIONS))
    assert out["text_embeds"].shape == (3, LENGTH, 8 * 32) and out["text_embeds"].dtype == torch.float32
    pipe = Flux3TextEncoderStep().init_pipeline()
    parts = load_components(tiny_flux3)
    pipe.update_components(text_encoder=parts["text_encoder"], tokenizer=parts["tokenizer"])
    windows = []
    for row, caption in enumerate(CAPTIONS):
        with torch.no_grad():
            want = pipe(prompt=caption, max_sequence_length=LENGTH, output="prompt_embeds")
        n = want.shape[1]
        windows.append(n)
        torch.testing.assert_close(out["text_embeds"][row, :n], want[0], atol=1e-6, rtol=0)
        assert out["text_valid"][row].tolist() == [1] * n + [0] * (LENGTH - n)
        assert not out["text_embeds"][row, n:].any()
    assert windows == [80, LENGTH, 80]  # short captions fill one window of 80; the long one is cut at the cap


def test_latents_are_the_vae_encoder_steps(tiny_flux3: Path) -> None:
    from diffusers.modular_pipelines.flux3.encoders import Flux3VaeEncoderStep

    enc = flux3.load_encoders(cfg_of(tiny_flux3), CPU)
    pixels = torch.rand(2, 3, 32, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    out = flux3.encode_batch(enc, EncodeBatch(pixels=pixels))
    pipe = Flux3VaeEncoderStep().init_pipeline()
    pipe.update_components(vae=load_components(tiny_flux3)["vae"])
    with torch.no_grad():
        (want,) = pipe(condition_images=[pixels], output="image_cond_latents")
    assert out["latents"].shape == want.shape == (2, 16, 2, 4)
    torch.testing.assert_close(out["latents"], want, atol=1e-5, rtol=0)
