"""Issue 23, test 1: the cached text is what the pipelines' own ``encode_prompt`` computes (template, the dropped
template tokens, the last hidden state, the mask), padded to the fixed length: for Qwen-Image, and for
Qwen-Image-Edit and Edit-2509 with the reference images resized and seen by Qwen2.5-VL as the pipelines' ``__call__``
hands them over; the latents are the pipelines' normalised image latents."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.schema import validate
from diffpipe_core.types import EncodeBatch
from diffpipe_qwenimage.config import QwenImageConfig, QwenImageEditConfig
from diffpipe_qwenimage.edit import plugin as edit
from diffpipe_qwenimage.plugin import plugin as qwen
from diffpipe_qwenimage.testing import load_pipeline
from diffpipe_qwenimage.vision import to_pil

CAPTIONS = ["a red cat on the house", "a dog", ""]
VL_AREA = 56 * 56  # tiny stand-in for the pipelines' 1024x1024 / 384x384


def pixels(seed: int, h: int = 32, w: int = 48) -> torch.Tensor:
    """An 8-bit image as the data path decodes it: ``u8 / 127.5 - 1``."""
    u8 = torch.randint(0, 256, (3, h, w), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return u8.float().div(127.5).sub(1.0)


def cfg_of(schema, path: Path, **extra):
    table = {"type": "x", "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 64}
    return validate(schema, {**table, **extra}, "test")


def test_text_to_image_captions_equal_encode_prompt(tiny_qwen: Path) -> None:
    cfg = cfg_of(QwenImageConfig, tiny_qwen)
    enc = qwen.load_encoders(cfg, torch.device("cpu"))
    out = qwen.encode_batch(enc, EncodeBatch(captions=CAPTIONS))
    pipe = load_pipeline(tiny_qwen)
    with torch.no_grad():
        want, mask = pipe.encode_prompt(CAPTIONS, device=torch.device("cpu"), max_sequence_length=64)
    n = want.shape[1]
    assert out["text_embeds"].shape == (3, 64, 32) and out["text_mask"].shape == (3, 64)
    torch.testing.assert_close(out["text_embeds"][:, :n], want, atol=1e-6, rtol=0)
    assert torch.equal(out["text_mask"][:, :n], mask.long()) and not out["text_mask"][:, n:].any()
    assert not out["text_embeds"][:, n:].any()  # padding is zeros
    # the template's 34 tokens are dropped: the empty caption keeps only "<|im_end|>\n<|im_start|>assistant\n"
    suffix = len(pipe.tokenizer("<|im_end|>\n<|im_start|>assistant\n").input_ids)
    assert int(out["text_mask"][2].sum()) == suffix


@pytest.mark.parametrize("folder", ["tiny_edit", "tiny_edit_plus"])
def test_edit_instructions_equal_encode_prompt_with_their_images(folder: str, request: pytest.FixtureRequest) -> None:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    path = request.getfixturevalue(folder)
    plus = folder == "tiny_edit_plus"
    cfg = cfg_of(QwenImageEditConfig, path, vl_image_area=VL_AREA)
    enc = edit.load_encoders(cfg, torch.device("cpu"))
    controls = [(pixels(1), pixels(2, 48, 32)) if plus else (pixels(1),), (pixels(3),), ()]
    out = edit.encode_batch(enc, EncodeBatch(captions=CAPTIONS, control_pixels=controls))
    pipe = load_pipeline(path)
    for i, (caption, images) in enumerate(zip(CAPTIONS, controls)):
        pil = []
        for p in images:  # as the pipelines' __call__ resize before encode_prompt
            image = to_pil(p)
            w, h = calculate_dimensions(VL_AREA, image.width / image.height)
            pil.append(pipe.image_processor.resize(image, h, w))
        if not pil and not plus:  # Qwen-Image-Edit without an image: its template without the vision block
            pipe.prompt_template_encode = pipe.prompt_template_encode.replace(
                "<|vision_start|><|image_pad|><|vision_end|>", ""
            )
        image = (pil if plus else pil[0]) if pil else None
        with torch.no_grad():
            want, mask = pipe.encode_prompt(caption, image=image, device=torch.device("cpu"))
        assert mask is None  # one prompt: no padding
        n = want.shape[1]
        torch.testing.assert_close(out["text_embeds"][i : i + 1, :n], want, atol=1e-6, rtol=0)
        assert out["text_mask"][i, :n].all() and not out["text_mask"][i, n:].any()
    # the vision tokens are part of the embedding: (64 / 28 rounded)^2 / 4 merged patches per 56x56-area image
    assert out["text_mask"][0].sum() > out["text_mask"][2].sum() + 4


def test_edit_with_one_image_refuses_two(tiny_edit: Path) -> None:
    enc = edit.load_encoders(cfg_of(QwenImageEditConfig, tiny_edit), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"QwenImageEditPipeline.*one reference image.*QwenImageEditPlusPipeline"):
        edit.encode_batch(enc, EncodeBatch(pixels=torch.zeros(1, 3, 32, 32), control_index=1))
    with pytest.raises(ValueError, match=r"takes one reference image, but an item has 2"):
        edit.encode_batch(enc, EncodeBatch(captions=["x"], control_pixels=[(pixels(1), pixels(2))]))


@pytest.mark.parametrize("control", [None, 0])
def test_latents_are_the_pipelines_normalised_image_latents(tiny_edit_plus: Path, control: int | None) -> None:
    cfg = cfg_of(QwenImageEditConfig, tiny_edit_plus)
    enc = edit.load_encoders(cfg, torch.device("cpu"))
    image = torch.stack([pixels(5), pixels(6)])
    out = edit.encode_batch(enc, EncodeBatch(pixels=image, control_index=control))
    pipe = load_pipeline(tiny_edit_plus)
    with torch.no_grad():
        want = pipe._encode_vae_image(image.unsqueeze(2), generator=None)
    assert out["latents"].shape == (2, 4, 4, 6)
    torch.testing.assert_close(out["latents"], want[:, :, 0], atol=1e-6, rtol=0)
