"""Krea 2's cached text is what ``Krea2Pipeline.encode_prompt`` computes (its template with the padding in the middle,
the system turn it drops, the 12 tapped Qwen3-VL layers, the mask), each caption's tokens moved to the front; the
latents are the pipeline's normalised latents."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.schema import validate
from diffpipe_core.types import EncodeBatch
from diffpipe_krea.config import Krea2Config
from diffpipe_krea.plugin import plugin
from diffpipe_krea.testing import PREFIX, SUFFIX, load_pipeline

CAPTIONS = ["a red cat on the house", "a dog", ""]
CPU = torch.device("cpu")


def cfg_of(path: Path, **extra):
    table = {"type": "krea2", "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 24}
    return validate(Krea2Config, {**table, **extra}, "test")


def test_captions_equal_encode_prompt(tiny_krea2: Path) -> None:
    enc = plugin.load_encoders(cfg_of(tiny_krea2), CPU)
    out = plugin.encode_batch(enc, EncodeBatch(captions=CAPTIONS))
    pipe = load_pipeline(tiny_krea2)
    with torch.no_grad():
        want, mask = pipe.encode_prompt(CAPTIONS, device=CPU, max_sequence_length=24)
    assert want.shape == (3, 24, 12, 32) and out["text_embeds"].shape == (3, 24, 12, 32)
    assert out["text_mask"].shape == (3, 24) and out["text_embeds"].dtype == torch.float32
    for row in range(3):
        n = int(mask[row].sum())
        assert mask[row, -5:].all() and not mask[row].all()  # padded, the closing turn after the padding
        torch.testing.assert_close(out["text_embeds"][row, :n], want[row][mask[row]], atol=1e-6, rtol=0)
        assert out["text_mask"][row].tolist() == [1] * n + [0] * (24 - n)
        assert not out["text_embeds"][row, n:].any()
    # the system turn is dropped: the empty caption keeps the template's closing turn alone
    tok = pipe.tokenizer
    assert len(tok(PREFIX).input_ids) == pipe.prompt_template_encode_start_idx  # 34 tokens, as the real tokenizer's
    assert int(out["text_mask"][2].sum()) == len(tok(SUFFIX).input_ids) == 5
    # the taps are the folder's layers of the encoder's hidden states (12 of 37), not the last state
    assert torch.equal(torch.tensor(pipe.text_encoder_select_layers), torch.arange(2, 36, 3))


def test_latents_are_the_pipelines_normalised_latents(tiny_krea2: Path) -> None:
    enc = plugin.load_encoders(cfg_of(tiny_krea2), CPU)
    pixels = torch.rand(2, 3, 32, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    out = plugin.encode_batch(enc, EncodeBatch(pixels=pixels))
    pipe = load_pipeline(tiny_krea2)
    with torch.no_grad():
        z = pipe.vae.encode(pixels.unsqueeze(2)).latent_dist.mode()
    assert out["latents"].shape == (2, 4, 4, 8)
    # the pipeline decodes latents / (1 / latents_std) + latents_mean: the cache holds its inverse
    std = torch.tensor(pipe.vae.config.latents_std).view(1, 4, 1, 1, 1)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, 4, 1, 1, 1)
    torch.testing.assert_close(out["latents"], ((z - mean) / std)[:, :, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(plugin.denormalize(out["latents"], pipe.vae), z, atol=1e-5, rtol=0)
