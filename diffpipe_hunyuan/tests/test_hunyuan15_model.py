"""HunyuanVideo-1.5 pieces against diffusers, in-process: the text tensors (Qwen2.5-VL and glyph ByT5) and the
image-to-video conditioning against the pipelines' own ``encode_prompt``, ``prepare_cond_latents_and_mask`` and
``encode_image``; the pipeline layers against ``HunyuanVideo15Transformer3DModel.forward``; both on-disk layouts load
to the same weights; per-stage loading reads only the stage's tensors; Tencent's layout round trip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.registry import Registry
from diffpipe_core.schema import validate
from diffpipe_core.testing.layouts import assert_round_trip, assert_same_weights
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_hunyuan.i2v15 import condition_tensor
from diffpipe_hunyuan.i2v15 import plugin as i2v
from diffpipe_hunyuan.original15 import diffusers_to_original, original_to_diffusers
from diffpipe_hunyuan.plugin15 import plugin as t2v
from diffpipe_hunyuan.testing15 import original_path

CPU = torch.device("cpu")
PLUGINS = {"hunyuan-video-1.5": t2v, "hunyuan-video-1.5-i2v": i2v}
CAPTIONS = ["a red cat", 'a sign saying "open" on a house']


def config(plugin, path: Path, crop: int, **kw):
    table = {
        "type": plugin.spec.name,
        "path": path,
        "dtype": "float32",
        "encoder_dtype": "float32",
        "text_max_length": 16,
        "text_crop_start": crop,
        "glyph_max_length": 12,
        **kw,
    }
    return validate(plugin.spec.config_schema, table, "test")


@pytest.fixture(params=list(PLUGINS))
def entry(request, tiny_hunyuan15: Path, tiny_hunyuan15_i2v: Path):
    """``(plugin, folder)`` of each entry point."""
    name = request.param
    return PLUGINS[name], tiny_hunyuan15_i2v if name.endswith("i2v") else tiny_hunyuan15


def pipeline(plugin, folder: Path):
    import diffusers

    return getattr(diffusers, plugin.pipeline_class).from_pretrained(str(folder), local_files_only=True)


def test_text_matches_the_pipeline_encode_prompt(entry, crop_start15: int) -> None:
    plugin, folder = entry
    enc = plugin.load_encoders(config(plugin, folder, crop_start15), CPU)
    text = plugin.encode_batch(enc, EncodeBatch(captions=CAPTIONS))
    pipe = pipeline(plugin, folder)
    pipe.tokenizer_max_length, pipe.prompt_template_encode_start_idx, pipe.tokenizer_2_max_length = 16, crop_start15, 12
    with torch.no_grad():  # as the pipeline's __call__ runs it
        embeds, mask, glyph, glyph_mask = pipe.encode_prompt(CAPTIONS, device=CPU, dtype=torch.float32, batch_size=2)
    assert text["text_embeds"].shape == (2, 16, 32) and torch.equal(text["text_embeds"], embeds)
    assert torch.equal(text["text_mask"], mask.long())
    assert text["glyph_embeds"].shape == (2, 12, 24) and torch.equal(text["glyph_embeds"], glyph)
    assert torch.equal(text["glyph_mask"], glyph_mask.long())
    # the crop left the captions (and the chat template's closing tokens); only the quoted caption has glyph text
    lengths = text["text_mask"].sum(dim=1).tolist()
    assert 3 <= lengths[0] < lengths[1] <= 16, lengths
    assert text["glyph_mask"].sum(dim=1).tolist()[0] == 0 and text["glyph_mask"][1].sum() > 4
    assert text["glyph_embeds"][0].abs().max() == 0 and text["glyph_embeds"][1].abs().max() > 0


def test_i2v_conditioning_matches_the_pipeline(tiny_hunyuan15_i2v: Path, crop_start15: int) -> None:
    enc = i2v.load_encoders(config(i2v, tiny_hunyuan15_i2v, crop_start15), CPU)
    pipe = pipeline(i2v, tiny_hunyuan15_i2v)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8))
    first = pipe.video_processor.preprocess(image, height=32, width=48)  # (1, 3, H, W) in [-1, 1], as decoded media
    clip = torch.cat([first[:, :, None], torch.rand(1, 3, 4, 32, 48) * 2 - 1], dim=2)
    media = i2v.encode_batch(enc, EncodeBatch(pixels=clip, first_frames=first))
    assert media["latents"].shape == (1, 4, 2, 2, 3) and media["first_frame_latents"].shape == (1, 4, 1, 2, 3)
    with torch.no_grad():
        cond, mask = pipe.prepare_cond_latents_and_mask(
            latents=torch.zeros(1, 4, 2, 2, 3), image=image, batch_size=1, height=32, width=48,
            dtype=torch.float32, device=CPU,
        )
        embeds = pipe.encode_image(image, batch_size=1, device=CPU, dtype=torch.float32)
    assert torch.equal(condition_tensor(media["first_frame_latents"], 2), torch.cat([cond, mask], dim=1))
    assert media["image_embeds"].shape == (1, 16, 16) and torch.equal(media["image_embeds"], embeds)
    # images (no first frame) are plain 1-frame videos
    image_only = i2v.encode_batch(enc, EncodeBatch(pixels=first))
    assert set(image_only) == {"latents"} and image_only["latents"].shape == (1, 4, 1, 2, 3)


def batch(conditioned: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    text_mask = torch.zeros(2, 16, dtype=torch.long)
    text_mask[0, :5], text_mask[1, :11] = 1, 1
    glyph_mask = torch.zeros(2, 12, dtype=torch.long)
    glyph_mask[1, :7] = 1
    out = {
        "latents": torch.randn(2, 4, 3, 2, 3, generator=g),
        "text_embeds": torch.randn(2, 16, 32, generator=g),
        "text_mask": text_mask,
        "glyph_embeds": torch.randn(2, 12, 24, generator=g) * glyph_mask[..., None],
        "glyph_mask": glyph_mask,
    }
    if conditioned:
        out["first_frame_latents"] = torch.randn(2, 4, 1, 2, 3, generator=g)
        out["image_embeds"] = torch.randn(2, 16, 16, generator=g)
    return out


@pytest.mark.parametrize("conditioned", [False, True])
def test_layers_compute_the_diffusers_forward(
    tiny_hunyuan15: Path, tiny_hunyuan15_i2v: Path, crop_start15: int, conditioned: bool
) -> None:
    """Image-to-video with its conditioning; text-to-video (the t2v model: no condition, no image tokens)."""
    plugin, folder = (i2v, tiny_hunyuan15_i2v) if conditioned else (t2v, tiny_hunyuan15)
    cfg = config(plugin, folder, crop_start15)
    model = plugin.load_diffusion_model(cfg, CPU, torch.float32).eval()
    data = batch(conditioned)
    inputs, targets = plugin.prepare_inputs(data, TrainingContext(model_config=cfg), torch.Generator().manual_seed(0))
    x_t, t = inputs[:2]
    assert len(inputs) == (8 if conditioned else 6)
    assert torch.allclose(x_t, data["latents"] + t.view(-1, 1, 1, 1, 1) * targets[0], atol=1e-5)
    out = inputs
    with torch.no_grad():
        for layer in plugin.split_into_layers(model, cfg):
            out = layer(out)
        condition = inputs[6] if conditioned else torch.zeros(2, 5, 3, 2, 3)
        image = inputs[7] if conditioned else torch.zeros(2, 16, 16)  # the text-to-video pipeline's zero image
        expected = model(
            hidden_states=torch.cat([x_t, condition], dim=1),
            timestep=t * 1000,
            encoder_hidden_states=inputs[2],
            encoder_attention_mask=inputs[3],
            encoder_hidden_states_2=inputs[4],
            encoder_attention_mask_2=inputs[5],
            image_embeds=image,
        ).sample
    assert out[0].shape == data["latents"].shape
    assert torch.allclose(out[0], expected, atol=1e-5), (out[0] - expected).abs().max()


def test_both_layouts_load_the_same_weights(tiny_hunyuan15: Path, crop_start15: int) -> None:
    folder = t2v.load_diffusion_model(config(t2v, tiny_hunyuan15, crop_start15), CPU, torch.float32)
    single_cfg = config(t2v, tiny_hunyuan15, crop_start15, diffusion_model=original_path(tiny_hunyuan15))
    single = t2v.load_diffusion_model(single_cfg, CPU, torch.float32)
    assert_same_weights(folder.state_dict(), single.state_dict(), at_least=100)
    # the single file is Tencent's layout: split q, k, v, the 1.5 embedders, no diffusers names
    keys = set(load_file(str(original_path(tiny_hunyuan15))))
    assert {"double_blocks.1.img_attn_q.weight", "double_blocks.0.txt_attn_v.bias", "byt5_in.fc3.weight"} <= keys
    assert {"vision_in.proj.4.weight", "cond_type_embedding.weight", "time_in.mlp.2.weight"} <= keys
    assert "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight" in keys
    assert not any("transformer_blocks" in k or "img_attn_qkv" in k for k in keys)
    assert t2v.validate_model_files(single_cfg) == []


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_per_stage_loading_reads_only_the_stage_layers(tiny_hunyuan15: Path, crop_start15: int, layout: str) -> None:
    single = {"diffusion_model": original_path(tiny_hunyuan15)} if layout == "original" else {}
    registry = Registry()
    assert registry.register_model("hunyuan-video-1.5", t2v).ok
    cfg = config(t2v, tiny_hunyuan15, crop_start15, **single)
    stages = assert_stages_read_their_own(registry.model("hunyuan-video-1.5"), cfg)
    heads = ("double_", "transformer_")
    blocks = [{".".join(k.split(".")[:2]) for k in s.reads if k.startswith(heads)} for s in stages]
    last = "double_blocks.1" if single else "transformer_blocks.1"
    assert last in blocks[-1] and not blocks[0] & blocks[-1], blocks


def test_tencent_and_fused_layouts_round_trip(tiny_hunyuan15: Path) -> None:
    state = load_file(str(tiny_hunyuan15 / "transformer" / "diffusion_pytorch_model.safetensors"))
    swapped = ("final_layer.adaLN_modulation.1.weight", "norm_out.linear.weight")
    original = assert_round_trip(state, diffusers_to_original, original_to_diffusers, swapped)
    assert torch.equal(original["double_blocks.0.img_attn_k.weight"], state["transformer_blocks.0.attn.to_k.weight"])
    fused = assert_round_trip(state, lambda s: diffusers_to_original(s, fused=True), original_to_diffusers, swapped)
    q, k, v = fused["double_blocks.1.txt_attn_qkv.weight"].chunk(3)
    assert torch.equal(v, state["transformer_blocks.1.attn.add_v_proj.weight"])
