"""Ideogram 4's cached text is what ``Ideogram4Pipeline.encode_prompt`` computes (its chat template, its left padding,
the 13 tapped Qwen3-VL layers interleaved per token, the padding zeroed), each caption's tokens moved to the front;
a caption over ``text_max_length`` is refused by name; the latents are the pipeline's normalised tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.schema import validate
from diffpipe_core.types import EncodeBatch
from diffpipe_ideogram.config import Ideogram4Config
from diffpipe_ideogram.plugin import patchify, plugin, tokens, unpatchify
from diffpipe_ideogram.testing import load_pipeline

CAPTIONS = ["a red cat on the house", "a dog", ""]
CPU = torch.device("cpu")
LENGTH = 32


def cfg_of(path: Path, **extra):
    table = {"type": "ideogram4", "path": path, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": LENGTH}
    return validate(Ideogram4Config, {**table, **extra}, "test")


def test_captions_equal_encode_prompt(tiny_ideogram4: Path) -> None:
    enc = plugin.load_encoders(cfg_of(tiny_ideogram4), CPU)
    out = plugin.encode_batch(enc, EncodeBatch(captions=CAPTIONS))
    pipe = load_pipeline(tiny_ideogram4)
    with torch.no_grad():
        want, _, _, indicator = pipe.encode_prompt(CAPTIONS, grid_h=2, grid_w=2, max_sequence_length=LENGTH,
                                                   device=CPU)
    features = 13 * 32
    assert want.shape == (3, LENGTH + 4, features) and out["text_embeds"].shape == (3, LENGTH, features)
    assert out["text_mask"].shape == (3, LENGTH) and out["text_embeds"].dtype == torch.float32
    for row in range(3):
        mask = indicator[row, :LENGTH] == 3
        n = int(mask.sum())
        assert 0 < n < LENGTH and mask[-n:].all()  # the pipeline pads on the left
        torch.testing.assert_close(out["text_embeds"][row, :n], want[row, :LENGTH][mask], atol=1e-6, rtol=0)
        assert out["text_mask"][row].tolist() == [1] * n + [0] * (LENGTH - n)
        assert not out["text_embeds"][row, n:].any()
    # the taps: decoder layers 0, 3, ..., 33 (and 35) interleaved per feature (d-major, layer-minor)
    ids = pipe.tokenizer(pipe.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "a dog"}]}], add_generation_prompt=True,
        tokenize=False), return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        states = pipe.text_encoder.language_model(ids, output_hidden_states=True).hidden_states
    taps = torch.stack([states[i + 1] for i in range(0, 34, 3)], dim=-1)[0]  # the 36th (last) state is normed
    got = out["text_embeds"][1, : ids.shape[1]].view(-1, 32, 13)
    torch.testing.assert_close(got[:, :, :12], taps, atol=1e-5, rtol=1e-5)


def test_a_caption_over_the_length_is_refused_by_name(tiny_ideogram4: Path) -> None:
    enc = plugin.load_encoders(cfg_of(tiny_ideogram4, text_max_length=12), CPU)
    refused = r"caption 'a red cat on the house' is \d+ Qwen3-VL tokens .* text_max_length = 12"
    with pytest.raises(ValueError, match=refused):
        plugin.encode_batch(enc, EncodeBatch(captions=CAPTIONS))


def test_latents_are_the_pipelines_normalised_tokens(tiny_ideogram4: Path) -> None:
    enc = plugin.load_encoders(cfg_of(tiny_ideogram4), CPU)
    pixels = torch.rand(2, 3, 32, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    masks = torch.ones(2, 1, 32, 64)
    masks[:, :, :, :32] = 0
    out = plugin.encode_batch(enc, EncodeBatch(pixels=pixels, masks=masks))
    pipe = load_pipeline(tiny_ideogram4)
    with torch.no_grad():
        z = pipe.vae.encode(pixels).latent_dist.mode()
    assert out["latents"].shape == (2, 16, 2, 4) and out["mask"].shape == (2, 1, 2, 4)
    assert out["mask"][0, 0].tolist() == [[0, 0, 1, 1]] * 2
    # the pipeline's decoding of its packed tokens: z * bn_std + bn_mean, viewed (gh, gw, 2, 2, C) and unpatchified
    x = tokens(out["latents"])
    bn_std = torch.sqrt(pipe.vae.bn.running_var + pipe.vae.config.batch_norm_eps)
    x = x * bn_std + pipe.vae.bn.running_mean
    x = x.view(2, 2, 4, 2, 2, 4).permute(0, 5, 1, 3, 2, 4).reshape(2, 4, 4, 8)
    torch.testing.assert_close(x, z, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plugin.denormalize(out["latents"], pipe.vae), z, atol=1e-5, rtol=1e-5)
    assert torch.equal(unpatchify(patchify(z)), z)
