"""Qwen-Image 2.1's cached text is what ``QwenImage21Pipeline.encode_prompt`` computes (its template, the system turn it
drops, Qwen3-VL's last decoder layer before the final norm, the mask), padded to the fixed length; the latents are the
pipeline's normalised latents of the opaque RGBA image."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.schema import validate
from diffpipe_core.types import EncodeBatch
from diffpipe_qwenimage.config import QwenImage21Config
from diffpipe_qwenimage.qwen21 import plugin
from diffpipe_qwenimage.testing21 import load_pipeline

CAPTIONS = ["a red cat on the house", "a dog", ""]
CPU = torch.device("cpu")


def cfg_of(path: Path, **extra):
    table = {"type": "qwen-image-2.1", "path": path, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": 32}
    return validate(QwenImage21Config, {**table, **extra}, "test")


def test_captions_equal_encode_prompt(tiny_qwen21: Path) -> None:
    enc = plugin.load_encoders(cfg_of(tiny_qwen21), CPU)
    out = plugin.encode_batch(enc, EncodeBatch(captions=CAPTIONS))
    pipe = load_pipeline(tiny_qwen21)
    with torch.no_grad():
        want, mask, image_slots = pipe.encode_prompt(CAPTIONS, device=CPU)
    n = want.shape[1]
    assert out["text_embeds"].shape == (3, 32, 32) and out["text_mask"].shape == (3, 32)
    torch.testing.assert_close(out["text_embeds"][:, :n], want, atol=1e-6, rtol=0)
    assert torch.equal(out["text_mask"][:, :n], mask.long()) and not out["text_mask"][:, n:].any()
    assert not out["text_embeds"][:, n:].any() and not image_slots.any()  # zero padding; no image slots
    # the system turn is dropped: the empty caption (" " for the pipeline) keeps the user turn and the assistant's
    kept = pipe.processor.tokenizer("<|im_start|>user\n <|im_end|>\n<|im_start|>assistant\n").input_ids
    assert int(out["text_mask"][2].sum()) == len(kept)
    # the pipeline's hidden state is the last decoder layer's before the final norm, which encode_prompt must keep
    with torch.no_grad():
        ids = pipe.processor(text=[pipe.prompt_template_t2i.format(CAPTIONS[1])], return_tensors="pt")
        normed = pipe.text_encoder(**ids, output_hidden_states=True).hidden_states[-1][0, pipe._drop_idx :]
    assert not torch.allclose(normed, out["text_embeds"][1, : normed.shape[0]], atol=1e-3)


def test_latents_are_the_pipelines_normalised_rgba_latents(tiny_qwen21: Path) -> None:
    from PIL import Image

    enc = plugin.load_encoders(cfg_of(tiny_qwen21), CPU)
    u8 = torch.randint(0, 256, (2, 3, 32, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    out = plugin.encode_batch(enc, EncodeBatch(pixels=u8.float() / 127.5 - 1))
    pipe = load_pipeline(tiny_qwen21)
    images = [Image.fromarray(u8[i].permute(1, 2, 0).numpy()).convert("RGBA") for i in range(2)]
    with torch.no_grad():  # as __call__ preprocesses a condition image for its VAE, RGBA kept
        want = pipe._encode_vae_image(pipe.image_processor.preprocess(images, 32, 64).unsqueeze(2), None)
    assert out["latents"].shape == (2, 4, 2, 4)
    torch.testing.assert_close(out["latents"], want[:, :, 0], atol=1e-5, rtol=0)
