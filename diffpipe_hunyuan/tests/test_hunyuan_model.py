"""Issue points 1 and 4 and the model pieces against diffusers: both on-disk layouts load to the same weights;
per-stage loading fills only the stage's own layers; original key names against diffusers' own converter; the
text tensors against HunyuanVideoPipeline.encode_prompt; VAE latents (videos, images as 1 frame, masks, tiling);
the pipeline layers against HunyuanVideoTransformer3DModel.forward; clear errors on bad files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffpipe_core import EncodeBatch, TrainingContext
from diffpipe_core.model_files import model_file_problems
from diffpipe_core.registry import Registry
from diffpipe_core.schema import ConfigError
from diffpipe_core.testing.layouts import assert_same_weights
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_hunyuan.original import diffusers_to_original, original_to_diffusers
from diffpipe_hunyuan.plugin import plugin as hy
from diffpipe_hunyuan.testing import TinyHunyuanConfig, original_path, tiny_config, tiny_transformer

CPU = torch.device("cpu")


config = tiny_config


def test_both_layouts_load_the_same_weights(tiny_hunyuan: Path, crop_start: int) -> None:
    folder = hy.load_diffusion_model(config(tiny_hunyuan, crop_start), CPU, torch.float32)
    single_cfg = config(tiny_hunyuan, crop_start, diffusion_model=original_path(tiny_hunyuan))
    single = hy.load_diffusion_model(single_cfg, CPU, torch.float32)
    assert_same_weights(folder.state_dict(), single.state_dict(), at_least=100)
    # the single file really is in the original layout (fused qkv, Tencent names), not a diffusers dump
    keys = set(load_file(str(original_path(tiny_hunyuan))))
    assert {"double_blocks.1.img_attn_qkv.weight", "single_blocks.1.linear1.weight", "img_in.proj.weight"} <= keys
    assert "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight" in keys
    assert not any("transformer_blocks" in k for k in keys)


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_per_stage_loading_reads_only_the_stage_layers(tiny_hunyuan: Path, crop_start: int, layout: str) -> None:
    single = {"diffusion_model": original_path(tiny_hunyuan)} if layout == "original" else {}
    registry = Registry()
    assert registry.register_model("hunyuan-video", hy).ok
    stages = assert_stages_read_their_own(registry.model("hunyuan-video"), config(tiny_hunyuan, crop_start, **single))
    blocks = [{".".join(k.split(".")[:2]) for k in s.reads if "blocks." in k} for s in stages]
    if single:
        assert {"double_blocks.0", "double_blocks.1"} & blocks[0] and "single_blocks.1" in blocks[1]
    else:
        assert "transformer_blocks.0" in blocks[0] and "single_transformer_blocks.1" in blocks[1]


def test_original_key_names_match_diffusers_converter() -> None:
    """diffusers' converter handles only the full-size width (3072); compare key names and shapes on meta."""
    from diffusers.loaders.single_file_utils import convert_hunyuan_video_transformer_to_diffusers

    full_size = TinyHunyuanConfig(
        num_layers=1, num_single_layers=1, num_refiner_layers=2, num_attention_heads=24, attention_head_dim=128,
        rope_axes_dim=(16, 56, 56), text_dim=4096, clip_dim=768, latent_channels=16
    )
    with torch.device("meta"):
        model = tiny_transformer(full_size)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    ours = diffusers_to_original(model.state_dict())
    theirs = convert_hunyuan_video_transformer_to_diffusers(dict(ours))
    assert {k: v.shape for k, v in theirs.items()} == shapes
    assert {k: v.shape for k, v in original_to_diffusers(ours).items()} == shapes


def test_original_round_trip_values_and_final_swap(tiny_hunyuan: Path) -> None:
    state = load_file(str(tiny_hunyuan / "transformer" / "diffusion_pytorch_model.safetensors"))
    original = diffusers_to_original(state)
    shift, scale = original["final_layer.adaLN_modulation.1.weight"].chunk(2)
    d_scale, d_shift = state["norm_out.linear.weight"].chunk(2)  # diffusers: scale first; original: shift first
    assert torch.equal(shift, d_shift) and torch.equal(scale, d_scale)
    back = original_to_diffusers({f"model.diffusion_model.{k}": v for k, v in original.items()})
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_text_matches_hunyuan_pipeline_encode_prompt(tiny_hunyuan: Path, crop_start: int) -> None:
    from diffusers import HunyuanVideoPipeline
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    enc = hy.load_encoders(config(tiny_hunyuan, crop_start), CPU)
    captions = ["a red cat", "a dog walks on the river"]
    text = hy.encode_batch(enc, EncodeBatch(captions=captions))
    pipe = HunyuanVideoPipeline.from_pretrained(str(tiny_hunyuan), transformer=None, vae=None, local_files_only=True)
    template = {**DEFAULT_PROMPT_TEMPLATE, "crop_start": crop_start}
    embeds, pooled, mask = pipe.encode_prompt(captions, prompt_template=template, max_sequence_length=16)
    assert text["text_embeds"].shape == (2, 16, 32) and torch.equal(text["text_embeds"], embeds)
    assert torch.equal(text["text_mask"], mask.long()) and torch.equal(text["clip_pooled"], pooled)
    # the crop removed exactly the template's system prompt: the caption and its <|eot_id|> remain
    assert text["text_mask"].sum(dim=1).tolist() == [4, 7]
    assert not torch.equal(text["clip_pooled"][0], text["clip_pooled"][1])


def test_vae_latents_of_videos_images_and_masks(tiny_hunyuan: Path, crop_start: int) -> None:
    from diffusers import AutoencoderKLHunyuanVideo

    enc = hy.load_encoders(config(tiny_hunyuan, crop_start), CPU)
    vae = AutoencoderKLHunyuanVideo.from_pretrained(str(tiny_hunyuan / "vae"))
    video = torch.rand(2, 3, 9, 32, 48) * 2 - 1
    masks = torch.zeros(2, 1, 32, 48)
    masks[:, :, :16] = 1
    media = hy.encode_batch(enc, EncodeBatch(pixels=video, masks=masks))
    with torch.no_grad():
        expected = vae.encode(video).latent_dist.mode() * vae.config.scaling_factor
    assert media["latents"].shape == (2, 4, 3, 4, 6)  # (9 - 1) / 4 + 1 frames, 8x smaller
    assert torch.allclose(media["latents"], expected, atol=1e-6)
    assert media["mask"].shape == (2, 1, 1, 4, 6)
    assert media["mask"][..., :2, :].min() == 1 and media["mask"][..., 2:, :].max() == 0
    image = hy.encode_batch(enc, EncodeBatch(pixels=video[:, :, 0]))["latents"]  # 4-D: a 1-frame video
    with torch.no_grad():
        expected = vae.encode(video[:, :, :1]).latent_dist.mode() * vae.config.scaling_factor
    assert image.shape == (2, 4, 1, 4, 6) and torch.allclose(image, expected, atol=1e-6)


def test_vae_tiling_and_slicing_options(tiny_hunyuan: Path, crop_start: int) -> None:
    cfg = config(tiny_hunyuan, crop_start, vae_tiling=True, vae_tile_size=64, vae_tile_frames=8, vae_slicing=True)
    enc = hy.load_encoders(cfg, CPU)
    vae = enc.vae
    assert vae.use_tiling and vae.use_slicing
    assert (vae.tile_sample_min_height, vae.tile_sample_stride_height) == (64, 48)
    assert (vae.tile_sample_min_num_frames, vae.tile_sample_stride_num_frames) == (8, 4)
    video = torch.rand(1, 3, 9, 72, 72) * 2 - 1  # larger than a tile in space and time
    latents = hy.encode_batch(enc, EncodeBatch(pixels=video))["latents"]
    assert latents.shape == (1, 4, 3, 9, 9) and torch.isfinite(latents).all()
    with pytest.raises(ConfigError, match="vae_tile_frames: invalid value 6"):
        config(tiny_hunyuan, crop_start, vae_tile_frames=6)


@pytest.mark.parametrize("guidance", [1.0, 3.5])
def test_layers_compute_the_diffusers_forward(tiny_hunyuan: Path, crop_start: int, guidance: float) -> None:
    cfg = config(tiny_hunyuan, crop_start, guidance=guidance)
    model = hy.load_diffusion_model(cfg, CPU, torch.float32).eval()
    text_mask = torch.zeros(2, 16, dtype=torch.long)
    text_mask[0, :5], text_mask[1, :11] = 1, 1
    batch = {
        "latents": torch.randn(2, 4, 3, 4, 6),
        "text_embeds": torch.randn(2, 16, 32),
        "text_mask": text_mask,
        "clip_pooled": torch.randn(2, 32),
    }
    inputs, targets = hy.prepare_inputs(batch, TrainingContext(model_config=cfg), torch.Generator().manual_seed(0))
    x_t, t, _, _, _, guidance_in = inputs
    assert torch.allclose(x_t, batch["latents"] + t.view(-1, 1, 1, 1, 1) * targets[0], atol=1e-5)
    assert torch.all(guidance_in == guidance)
    out = inputs
    with torch.no_grad():
        for layer in hy.split_into_layers(model, cfg):
            out = layer(out)
        expected = model(
            hidden_states=x_t,
            timestep=t * 1000,
            encoder_hidden_states=inputs[2],
            encoder_attention_mask=inputs[3],
            pooled_projections=inputs[4],
            guidance=guidance_in * 1000,
        ).sample
    assert out[0].shape == batch["latents"].shape
    assert torch.allclose(out[0], expected, atol=1e-5), (out[0] - expected).abs().max()


def test_bad_single_file_names_file_and_key(tiny_hunyuan: Path, crop_start: int, tmp_path: Path) -> None:
    bad = load_file(str(original_path(tiny_hunyuan)))
    file = tmp_path / "bad.safetensors"
    load = lambda: hy.load_diffusion_model(  # noqa: E731
        config(tiny_hunyuan, crop_start, diffusion_model=file), CPU, torch.float32
    )
    save_file({**bad, "double_blocks.0.img_attn_extra.weight": torch.zeros(2)}, str(file))
    with pytest.raises(KeyError, match=r"bad\.safetensors.*unexpected.*double_blocks\.0\.img_attn_extra\.weight"):
        load()
    save_file({k: v for k, v in bad.items() if k != "img_in.proj.weight"}, str(file))
    with pytest.raises(KeyError, match=r"bad\.safetensors.*missing key 'img_in\.proj\.weight'"):
        load()
    save_file({**bad, "img_in.proj.bias": torch.zeros(3)}, str(file))
    with pytest.raises(ValueError, match=r"(?s)bad\.safetensors.*size mismatch for x_embedder\.proj\.bias"):
        load()


def test_validate_model_files(tiny_hunyuan: Path, crop_start: int, tmp_path: Path) -> None:
    registry = Registry()
    assert registry.register_model("hunyuan-video", hy).ok
    plugin = registry.model("hunyuan-video")
    assert plugin.has("validate_model_files")  # the core finds the hook (diffpipe validate, before caching)
    assert model_file_problems(plugin, config(tiny_hunyuan, crop_start)) == []
    single = config(tiny_hunyuan, crop_start, diffusion_model=original_path(tiny_hunyuan))
    assert hy.validate_model_files(single) == []
    diffusers_file = tiny_hunyuan / "transformer" / "diffusion_pytorch_model.safetensors"
    as_diffusers = config(tiny_hunyuan, crop_start, diffusion_model=diffusers_file)  # read in its own names
    assert hy.validate_model_files(as_diffusers) == [] and "diffusers" in hy.model_file_lines(as_diffusers)[0]
    other_model = tmp_path / "other_model.safetensors"
    save_file({"blocks.0.attn.qkv.weight": torch.zeros(4, 4)}, str(other_model))
    [problem] = hy.validate_model_files(config(tiny_hunyuan, crop_start, diffusion_model=other_model))
    assert str(other_model) in problem and "double_blocks.0.img_attn_qkv.weight" in problem

    other = tmp_path / "other"
    shutil.copytree(tiny_hunyuan, other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxPipeline"}))
    [problem] = hy.validate_model_files(config(other, crop_start))
    assert "model_index.json" in problem and "'FluxPipeline'" in problem and "'HunyuanVideoPipeline'" in problem
    (other / "model_index.json").write_text(json.dumps(index))
    vae_config = json.loads((other / "vae" / "config.json").read_text())
    (other / "vae" / "config.json").write_text(json.dumps({**vae_config, "_class_name": "AutoencoderKL"}))
    [problem] = hy.validate_model_files(config(other, crop_start))
    assert "vae/config.json" in problem and "'AutoencoderKL'" in problem and "AutoencoderKLHunyuanVideo" in problem

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty/transformer/config\.json"):
        hy.load_diffusion_model(config(tmp_path / "empty", crop_start), CPU, torch.float32)
    with pytest.raises(FileNotFoundError, match=r"empty/vae"):
        hy.load_encoders(config(tmp_path / "empty", crop_start), CPU)
