"""HunyuanImage-2.1 on tiny models: the cached text is ``HunyuanImagePipeline.encode_prompt``'s (Qwen2.5-VL's third
state from the end after the template's 34 tokens, and the glyph ByT5 branch for quoted text), the latents the VAE's
scaled mode; the layers chained compute the diffusers forward (base, and the distilled checkpoint's guidance and
MeanFlow time); samples equal the pipeline's for the same noise and prompt (its adaptive projected guider in both
phases; the distilled checkpoint without guidance); the conformance kit passes; Tencent's key table is diffusers'
conversion."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.schema import validate
from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_core.testing.sampling import assert_same_sample, registered, sample_latents
from diffpipe_core.types import EncodeBatch, SampleRequest
from diffpipe_hunyuan import layers21
from diffpipe_hunyuan.config import HunyuanImage21Config
from diffpipe_hunyuan.image21 import plugin
from diffpipe_hunyuan.testing21 import PREFIX, load_pipeline

CPU = torch.device("cpu")
CAPTIONS = ['a red cat holding a sign that says "HELLO"', "a dog", "", "the words ‘hi’ and 'yo' on a house"]
PROMPT, NEGATIVE, STEPS, SEED, SIZE = 'a red cat with the text "HELLO"', "blurry", 3, 5, 32


def cfg_of(path: Path, **extra) -> HunyuanImage21Config:
    table = {"type": "hunyuan-image-2.1", "path": path, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": 24, "glyph_max_length": 16}
    return validate(HunyuanImage21Config, {**table, **extra}, "test")


def test_captions_equal_encode_prompt_with_the_glyph_branch(tiny_hunyuan_image: Path) -> None:
    out = plugin.encode_batch(plugin.load_encoders(cfg_of(tiny_hunyuan_image), CPU), EncodeBatch(captions=CAPTIONS))
    pipe = load_pipeline(tiny_hunyuan_image)
    pipe.tokenizer_max_length, pipe.tokenizer_2_max_length = 24, 16
    assert len(pipe.tokenizer(PREFIX).input_ids) == pipe.prompt_template_encode_start_idx == 34  # as the real one
    with torch.no_grad():
        want = pipe.encode_prompt(CAPTIONS, device=CPU, batch_size=len(CAPTIONS))
    for key, expected in zip(("text_embeds", "text_mask", "glyph_embeds", "glyph_mask"), want, strict=True):
        assert out[key].shape == expected.shape, key
        torch.testing.assert_close(out[key].to(expected.dtype), expected, atol=1e-6, rtol=0)
    glyph = out["glyph_mask"].sum(dim=1).tolist()
    assert glyph[1] == glyph[2] == 0 and glyph[0] > 0 and glyph[3] > 0  # quotes only: ''' "" ‘’ “”
    assert not out["glyph_embeds"][1].any() and out["glyph_embeds"][0].abs().sum() > 0


def test_latents_are_the_vaes_scaled_mode(tiny_hunyuan_image: Path) -> None:
    enc = plugin.load_encoders(cfg_of(tiny_hunyuan_image), CPU)
    pixels = torch.rand(2, 3, 32, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    out = plugin.encode_batch(enc, EncodeBatch(pixels=pixels, masks=torch.ones(2, 1, 32, 64)))
    pipe = load_pipeline(tiny_hunyuan_image)
    with torch.no_grad():
        z = pipe.vae.encode(pixels).latent_dist.mode()
    assert out["latents"].shape == (2, 8, 8, 16) and out["mask"].shape == (2, 1, 8, 16)
    torch.testing.assert_close(out["latents"], z * pipe.vae.config.scaling_factor, atol=1e-5, rtol=0)
    assert pipe.vae.config.scaling_factor != 1.0


@pytest.mark.parametrize("variant", ["base", "distilled"])
def test_layers_chained_equal_the_forward(variant: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue("tiny_hunyuan_image" + ("_distilled" if variant == "distilled" else ""))
    model = plugin.load_diffusion_model(cfg_of(folder), CPU, torch.float32)
    assert model.config.use_meanflow == model.config.guidance_embeds == (variant == "distilled")
    g = torch.Generator().manual_seed(0)
    x, t, t_r = torch.randn(2, 8, 4, 6, generator=g), torch.rand(2, generator=g), torch.rand(2, generator=g)
    text, glyph = torch.randn(2, 7, 32, generator=g), torch.randn(2, 5, 32, generator=g)
    mask, glyph_mask = torch.ones(2, 7, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long)
    mask[1, 4:], glyph_mask[0, :3] = 0, 1
    guidance = torch.tensor([3.25, 2.0])
    extra = {"timestep_r": t_r * 1000, "guidance": guidance * 1000} if variant == "distilled" else {}
    with torch.no_grad():
        want = model(hidden_states=x, timestep=t * 1000, encoder_hidden_states=text, encoder_attention_mask=mask,
                     encoder_hidden_states_2=glyph, encoder_attention_mask_2=glyph_mask, **extra).sample
        out = (x, t, text, mask, glyph, glyph_mask, guidance, t_r)
        for layer in layers21.split_into_layers(model):
            out = layer(out)
        # the distilled embedders take part: other values, another output
        moved = layers21.split_into_layers(model)[0]((x, t, text, mask, glyph, glyph_mask, guidance + 1, t))[2]
    torch.testing.assert_close(out[0], want, atol=1e-5, rtol=1e-5)
    first = layers21.split_into_layers(model)[0]((x, t, text, mask, glyph, glyph_mask, guidance, t_r))[2]
    assert (variant == "distilled") == (not torch.allclose(moved, first))


@pytest.mark.parametrize(("prompt", "cfg_scale"), [(PROMPT, 1.0), (PROMPT, 3.0), ("a red cat", 3.0)])
def test_sample_equals_the_pipeline(tiny_hunyuan_image: Path, prompt: str, cfg_scale: float, monkeypatch) -> None:
    """3 steps with the folder's scheduler (shift 5); at cfg 3 the folder's ``AdaptiveProjectedMixGuidance``, CFG
    first and projected guidance with momentum after (the tiny guiders' start steps: 1, and 0 for ``ocr_guider``,
    which the pipeline takes for a prompt with quoted text)."""
    cfg = cfg_of(tiny_hunyuan_image)
    model = registered(plugin)
    (texts,) = encode_prompts(model, cfg, [prompt], NEGATIVE if cfg_scale > 1 else None, CPU)
    ours = sample_latents(model, cfg, SampleRequest(width=SIZE, height=SIZE, steps=STEPS), texts, SEED, cfg_scale)
    pipe = load_pipeline(tiny_hunyuan_image)
    pipe.tokenizer_max_length, pipe.tokenizer_2_max_length = 24, 16
    pipe.guider, pipe.ocr_guider = (g.new(guidance_scale=cfg_scale) for g in (pipe.guider, pipe.ocr_guider))
    noise = torch.randn(1, 8, 8, 8, generator=noise_generator(SEED, 0))
    with torch.no_grad():
        want = pipe(prompt=prompt, negative_prompt=NEGATIVE, latents=noise, num_inference_steps=STEPS, height=SIZE,
                    width=SIZE, output_type="latent").images
    assert_same_sample(ours, want, noise)
    if cfg_scale > 1:  # the projected guidance is not plain CFG: the same loop with CFG's combination differs
        monkeypatch.setattr(plugin, "guider_config", lambda model_config, ocr=False: {})
        request = SampleRequest(width=SIZE, height=SIZE, steps=STEPS)
        assert not torch.allclose(sample_latents(model, cfg, request, texts, SEED, cfg_scale), want, atol=1e-4)


def test_distilled_sample_equals_the_pipeline(tiny_hunyuan_image_distilled: Path) -> None:
    """The distilled folder (no guider): the pipeline's distilled guidance (``[sample] guidance``, else ``[model]
    guidance``) and MeanFlow's next timestep, at its scheduler's shift."""
    cfg = cfg_of(tiny_hunyuan_image_distilled, guidance=2.5)
    model = registered(plugin)
    (texts,) = encode_prompts(model, cfg, [PROMPT], None, CPU)
    ours = sample_latents(model, cfg, SampleRequest(width=SIZE, height=SIZE, steps=STEPS), texts, SEED)
    pipe = load_pipeline(tiny_hunyuan_image_distilled)
    assert pipe.guider is None and pipe.transformer.config.use_meanflow
    pipe.tokenizer_max_length, pipe.tokenizer_2_max_length = 24, 16
    noise = torch.randn(1, 8, 8, 8, generator=noise_generator(SEED, 0))
    with torch.no_grad():
        want = pipe(prompt=PROMPT, latents=noise, num_inference_steps=STEPS, height=SIZE, width=SIZE,
                    distilled_guidance_scale=2.5, output_type="latent").images
    assert_same_sample(ours, want, noise)


@pytest.mark.parametrize("variant", ["base", "distilled"])
def test_hunyuan_image_conforms(variant: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue("tiny_hunyuan_image" + ("_distilled" if variant == "distilled" else ""))
    table = {"type": "hunyuan-image-2.1", "path": folder, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": 16, "glyph_max_length": 8}
    pixels = torch.rand(2, 3, 32, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(plugin, "hunyuan-image-2.1", table, pixels=pixels, captions=['a "red" cat', "a dog"])


def test_tencent_table_is_diffusers_conversion(tiny_hunyuan_image: Path) -> None:
    """Tencent's layout as the table writes it (q, k, v fused; the final adaLN halves swapped) converts back through
    the table and, split as diffusers' conversion script splits it, names the same tensors."""
    from safetensors.torch import load_file

    from diffpipe_hunyuan.original21 import diffusers_to_original, layout_for_config
    from diffpipe_hunyuan.testing21 import original_path

    state = load_file(str(tiny_hunyuan_image / "transformer" / "diffusion_pytorch_model.safetensors"))
    original = load_file(str(original_path(tiny_hunyuan_image)))
    assert original.keys() == diffusers_to_original(state).keys()
    assert "double_blocks.0.img_attn_qkv.weight" in original and "byt5_in.fc3.weight" in original
    assert original["single_blocks.0.linear1.weight"].shape == (3 * 32 + 128, 32)
    shift, scale = original["final_layer.adaLN_modulation.1.weight"].chunk(2)
    torch.testing.assert_close(torch.cat([scale, shift]), state["norm_out.linear.weight"])
    config = dict(load_pipeline(tiny_hunyuan_image).transformer.config)
    back = layout_for_config(config).to_model(original, "test")
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
