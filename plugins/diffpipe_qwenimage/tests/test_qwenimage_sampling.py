"""Qwen-Image samples (issue 23, test 3): the plugin's denoising hooks under the core's loop equal
``QwenImagePipeline`` for the same tiny model, noise, prompt embeddings and steps, plain and with true CFG (the
pipeline's norm rescale, through the ``combine_guidance`` hook), the decoded image included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.parts.latents import pack_2x2, unpack_2x2
from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.schema import validate
from diffpipe_core.testing.sampling import assert_same_sample, registered, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_qwenimage.config import QwenImageConfig
from diffpipe_qwenimage.plugin import plugin as qwen
from diffpipe_qwenimage.testing import load_pipeline

PROMPT, NEGATIVE, STEPS, SEED, SIZE = "a red cat on a house", "blurry", 3, 5, 32


def pipeline_kwargs(texts, cfg_scale: float) -> dict:
    """The pipeline's arguments for our prompt tensors (each cut to its own length, as ``encode_prompt`` returns
    it), steps and size; with ``cfg_scale > 1`` the negative prompt's and ``true_cfg_scale``."""
    def cut(text: dict) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(text["text_mask"].sum())
        return text["text_embeds"][:, :n], text["text_mask"][:, :n]

    embeds, mask = cut(texts.cond)
    kwargs = {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "num_inference_steps": STEPS, "height": SIZE,
              "width": SIZE, "output_type": "latent"}
    if cfg_scale > 1:
        negative, negative_mask = cut(texts.uncond)
        kwargs.update(negative_prompt_embeds=negative, negative_prompt_embeds_mask=negative_mask,
                      true_cfg_scale=cfg_scale)
    return kwargs


def test_combine_guidance_rescales_to_the_conditional_norm() -> None:
    g = torch.Generator().manual_seed(0)
    uncond, cond = torch.randn(1, 4, 16, generator=g), torch.randn(1, 4, 16, generator=g)
    got = qwen.combine_guidance(uncond, cond, 3.0, torch.ones(2), 0, None)
    plain = uncond + 3.0 * (cond - uncond)
    torch.testing.assert_close(got.norm(dim=-1), cond.norm(dim=-1))
    torch.testing.assert_close(got / got.norm(dim=-1, keepdim=True), plain / plain.norm(dim=-1, keepdim=True))
    assert not torch.allclose(got, plain)


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_qwen_sample_equals_the_pipeline(tiny_qwen: Path, cfg_scale: float) -> None:
    plugin = registered(qwen, "qwen-image")
    assert all(plugin.has(h) for h in ("denoise_init", "denoise_inputs", "denoise_step", "combine_guidance"))
    table = {"type": "qwen-image", "path": tiny_qwen, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": 32}
    cfg = validate(QwenImageConfig, table, "test")
    negative = NEGATIVE if cfg_scale > 1 else None
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], negative, torch.device("cpu"))
    request = SampleRequest(width=SIZE, height=SIZE, steps=STEPS)
    ours = sample_latents(plugin, cfg, request, texts, SEED, cfg_scale)

    pipe = load_pipeline(tiny_qwen)
    noise = torch.randn((1, 1, 4, 4, 4), generator=noise_generator(SEED, 0))[:, 0]
    out = pipe(latents=pack_2x2(noise), **pipeline_kwargs(texts, cfg_scale)).images
    expected = unpack_2x2(out, 4, 4)
    assert ours.shape == (1, 4, 4, 4)
    assert_same_sample(ours, expected, noise)
    if cfg_scale > 1:  # the rescale matters: the plain combination lands elsewhere
        plain = sample_latents(registry_without_combine(), cfg, request, texts, SEED, cfg_scale)
        assert (plain - expected).abs().max() > 1e-3

    ((_, pixels),) = decode(plugin, cfg, {0: ours}, torch.device("cpu"))
    with torch.no_grad():
        z = ours.unsqueeze(2) / (1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, 4, 1, 1, 1))
        z = z + torch.tensor(pipe.vae.config.latents_mean).view(1, 4, 1, 1, 1)
        want = pipe.vae.decode(z).sample[0, :, 0].clamp(-1, 1)
    assert pixels.shape == (3, SIZE, SIZE)
    torch.testing.assert_close(pixels, want, rtol=1e-4, atol=1e-5)


def registry_without_combine():
    """The plugin with the core's plain guidance (``combine_guidance`` not implemented)."""
    from diffpipe_qwenimage.plugin import QwenImage

    class Plain(QwenImage):
        combine_guidance = None  # type: ignore[assignment]

    return registered(Plain(), "qwen-image")


@pytest.mark.parametrize("cfg_scale", [3.0])  # the plain path is the text-to-image test's
def test_edit_sample_with_reference_images_equals_the_edit_plus_pipeline(
    tiny_edit_plus: Path, tmp_path: Path, cfg_scale: float
) -> None:
    """``[sample] control_images``: each reference image seen by Qwen2.5-VL with the instruction and its latents
    appended to the target's, as ``QwenImageEditPlusPipeline`` does at its own sizes (Qwen2.5-VL sees each at
    ``CONDITION_IMAGE_SIZE``, 384x384; the VAE encodes each at ``VAE_IMAGE_SIZE``, 1024x1024, whatever the output
    size), for a 32x32 sample. The references are 1024x1024: at another size the pipeline resizes the original
    for Qwen2.5-VL while diffpipe resizes the one it encodes (as QwenImageEditPipeline does), a resampling apart."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
    from PIL import Image

    from diffpipe_core.testing.media import write_png
    from diffpipe_qwenimage.config import QwenImageEditConfig
    from diffpipe_qwenimage.edit import plugin as edit

    plugin = registered(edit, "qwen-image-edit")
    assert plugin.spec.control_sample_area == plus.VAE_IMAGE_SIZE
    references = [write_png(tmp_path / f"{k}.png", 1024, 1024, seed=k) for k in (1, 2)]
    table = {"type": "qwen-image-edit", "path": tiny_edit_plus, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": 512}
    cfg = validate(QwenImageEditConfig, table, "test")
    negative = NEGATIVE if cfg_scale > 1 else None
    (texts,) = encode_prompts(plugin, cfg, ["make it red"], negative, torch.device("cpu"), [references], (SIZE, SIZE))
    assert [texts.cond[f"control_{k}_latents"].shape[-2:] for k in range(2)] == [(128, 128)] * 2  # 1024 / 8
    request = SampleRequest(width=SIZE, height=SIZE, steps=STEPS)
    ours = sample_latents(plugin, cfg, request, texts, SEED, cfg_scale)

    pipe = load_pipeline(tiny_edit_plus)
    noise = torch.randn((1, 1, 4, 4, 4), generator=noise_generator(SEED, 0))[:, 0]
    images = [Image.open(p).convert("RGB") for p in references]
    out = pipe(image=images, latents=pack_2x2(noise), **pipeline_kwargs(texts, cfg_scale)).images
    assert_same_sample(ours, unpack_2x2(out, 4, 4), noise)
    # the instruction's embedding holds the references' vision tokens: it equals encode_prompt with the images
    # resized as the pipeline resizes them for Qwen2.5-VL
    with torch.no_grad():
        w, h = plus.calculate_dimensions(plus.CONDITION_IMAGE_SIZE, 1.0)
        images = [pipe.image_processor.resize(image, h, w) for image in images]
        want, _ = pipe.encode_prompt("make it red", image=images, device=torch.device("cpu"))
    n = int(texts.cond["text_mask"].sum())
    torch.testing.assert_close(texts.cond["text_embeds"][:, :n], want, atol=1e-6, rtol=0)
