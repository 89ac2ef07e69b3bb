"""HunyuanVideo-1.5 (and its image-to-video) from the files ComfyUI users keep (issue 35):
``hunyuanvideo1.5_720p_t2v_fp16.safetensors`` (as ComfyUI repackages it: Tencent's names with each double block's q,
k, v fused, under ``model.diffusion_model.``; Tencent's own split file loads too),
``hunyuanvideo15_vae_fp16.safetensors`` (Tencent's VAE layout, which ComfyUI's ``vae_refiner`` holds as is),
``qwen_2.5_vl_7b.safetensors`` (the language model under ComfyUI's ``model.``, beside its ``visual.`` tower) and
``byt5_small_glyphxl_fp16.safetensors`` (the glyph ByT5 in transformers' T5 names), beside a folder of only configs and
tokenizers: the weights load exactly as the folder's, and an fp8 scaled transformer stays quantized and loads per
stage."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.schema import validate
from diffpipe_core.testing.component_files import (
    assert_kept_quantized,
    assert_loads_as_the_folder,
    assert_same_state,
    assert_trains_as,
    assert_variant_loads_as_itself,
    comfyui_files,
    component_state,
    model_keys,
    quantize_file,
    save,
    train_from_files,
    variant_file,
    variant_model,
)
from diffpipe_hunyuan.i2v15 import plugin as i2v
from diffpipe_hunyuan.original15 import layouts_for_config
from diffpipe_hunyuan.plugin15 import plugin as t2v
from diffpipe_hunyuan.testing15 import original_path
from diffpipe_hunyuan.vae_layouts import vae15_table

CPU = torch.device("cpu")
ENCODERS = ("vae", "text_encoder", "text_encoder_2")
QWEN_PREFIX = "model."  # ComfyUI's Qwen2.5-VL file: the language model under model., its vision tower under visual.


def comfy_files(folder: Path, out: Path) -> dict:
    """``folder`` as ComfyUI component files under ``out`` (the transformer in ComfyUI's fused layout) and a
    config-only folder ``out/configs``; the Qwen2.5-VL file also holds a (random) vision tower, as ComfyUI's does."""
    files = comfyui_files(folder, out, lambda c: layouts_for_config(c)[1], vae15_table, {"text_encoder": QWEN_PREFIX})
    qwen = load_file(str(files["text_encoders"][0]))
    g = torch.Generator().manual_seed(0)
    qwen |= {f"visual.blocks.0.attn.{n}.weight": torch.randn(48, 16, generator=g) for n in ("qkv", "proj")}
    save(qwen, files["text_encoders"][0])
    return files


@pytest.fixture(scope="module")
def comfy(tiny_hunyuan15: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return comfy_files(tiny_hunyuan15, tmp_path_factory.mktemp("comfy"))


def config(plugin, path: Path, crop: int, **keys):
    table = {"type": plugin.spec.name, "path": path, "dtype": "float32", "encoder_dtype": "float32"}
    table |= {"text_max_length": 16, "text_crop_start": crop, "glyph_max_length": 12}
    return validate(plugin.spec.config_schema, {**table, **keys}, "test")


def files_of(comfy: dict, **keys) -> dict:
    """The ``[model]`` file keys, the ByT5 file first: which encoder each holds is read from its tensors."""
    found = {"diffusion_model": comfy["diffusion_model"], "vae": comfy["vae"]}
    return {**found, "text_encoders": comfy["text_encoders"][::-1], **keys}


def test_component_files_load_exactly_the_folders_weights(tiny_hunyuan15: Path, comfy: dict, crop_start15: int) -> None:
    cfg = config(t2v, comfy["configs"], crop_start15, **files_of(comfy))
    lines = "\n".join(t2v.model_file_lines(cfg))
    assert "diffusion_model: " in lines and "ComfyUI (fused q, k, v) layout" in lines
    assert f"vae: {comfy['vae']}: original Tencent layout" in lines and "(AutoencoderKLHunyuanVideo15)" in lines
    assert f"text_encoder: {comfy['text_encoders'][0]}: diffusers (under 'model')" in lines
    assert f"text_encoder_2: {comfy['text_encoders'][1]}: diffusers," in lines and "(T5EncoderModel)" in lines
    folder = config(t2v, tiny_hunyuan15, crop_start15)
    assert_loads_as_the_folder(t2v, cfg, folder, ENCODERS)
    # Tencent's own file (q, k, v split) over the same configs
    tencent = config(
        t2v, comfy["configs"], crop_start15, **files_of(comfy, diffusion_model=original_path(tiny_hunyuan15))
    )
    assert "original Tencent layout" in t2v.model_file_lines(tencent)[0]
    loaded = t2v.load_diffusion_model(tencent, CPU, torch.float32).state_dict()
    assert_same_state(loaded, t2v.load_diffusion_model(folder, CPU, torch.float32).state_dict())


def test_image_to_video_files_over_its_folder(tiny_hunyuan15_i2v: Path, crop_start15: int, tmp_path: Path) -> None:
    """The image-to-video transformer (with its SigLIP projection) and the shared VAE and text encoders as ComfyUI
    files, over the i2v folder, whose SigLIP image encoder ComfyUI keeps as a separate clip_vision file."""
    comfy = comfy_files(tiny_hunyuan15_i2v, tmp_path)
    keys = {k.removeprefix("model.diffusion_model.") for k in load_file(str(comfy["diffusion_model"]))}
    assert "vision_in.proj.1.weight" in keys
    cfg = config(i2v, tiny_hunyuan15_i2v, crop_start15, **files_of(comfy))
    folder = config(i2v, tiny_hunyuan15_i2v, crop_start15)
    assert_loads_as_the_folder(i2v, cfg, folder, (*ENCODERS, "image_encoder"))


def head(key: str) -> bool:
    """SigLIP's attention-pooling head (``vision_model.head.*``)."""
    return re.search(r"(?:^|\.)head\.", key) is not None


def test_the_siglip_image_encoder_from_its_comfyui_file(tiny_hunyuan15_i2v: Path, crop_start15: int, tmp_path) -> None:
    """ComfyUI's ``sigclip_vision_patch14_384.safetensors`` listed in ``text_encoders`` over the i2v folder: the image
    encoder is read from it (its tensors say which component it is), without the attention-pooling head the pipeline
    never runs (ComfyUI's file may lack it: zeros), and loads exactly the file's weights."""
    siglip = {k: v for k, v in component_state(tiny_hunyuan15_i2v, "image_encoder").items() if not head(k)}
    file = save({k: v + 1 for k, v in siglip.items()}, tmp_path / "sigclip_vision_patch14_384.safetensors")
    cfg = config(i2v, tiny_hunyuan15_i2v, crop_start15, text_encoders=[file])
    assert i2v.validate_model_files(cfg) == []
    assert f"image_encoder: {file}: diffusers, float32" in "\n".join(i2v.model_file_lines(cfg))
    got = i2v.load_encoders(cfg, CPU).image_encoder.state_dict()
    assert_same_state({k: v for k, v in got.items() if not head(k)}, {k: v + 1 for k, v in siglip.items()})
    assert any(head(k) for k in got) and all(not got[k].any() for k in got if head(k))


def test_a_quantized_transformer_stays_quantized(comfy: dict, crop_start15: int, tmp_path: Path) -> None:
    file = quantize_file(comfy["diffusion_model"], tmp_path / "hunyuanvideo1.5_fp8_scaled.safetensors", "fp8_scaled")
    cfg = config(t2v, comfy["configs"], crop_start15, **files_of(comfy, diffusion_model=file))
    plain = config(t2v, comfy["configs"], crop_start15, **files_of(comfy))
    assert_kept_quantized(t2v, cfg, plain, torch.float8_e4m3fn)


def test_a_file_of_another_variant_loads_as_itself(comfy: dict, crop_start15: int, tmp_path: Path) -> None:
    """Other block counts and heads than the folder's config: read from the file's tensors."""
    read = {"num_layers": 1, "num_refiner_layers": 2, "num_attention_heads": 3}
    variant = variant_model(t2v, comfy["configs"], **read)
    file = variant_file(t2v, variant, tmp_path / "hunyuan15.safetensors")
    cfg = config(t2v, comfy["configs"], crop_start15, **files_of(comfy, diffusion_model=file))
    assert_variant_loads_as_itself(t2v, cfg, variant, read)


@pytest.mark.slow
def test_component_files_train_as_the_folder(hunyuan15_run: Path, tiny_hunyuan15: Path, tmp_path: Path) -> None:
    """The shared text-to-video run (Tencent's single file over the folder), again from ComfyUI files only: equal
    losses and LoRA files."""
    from test_hunyuan15_train import write_project

    config = write_project(tmp_path, "hunyuan-video-1.5", tiny_hunyuan15)
    files = comfy_files(tmp_path / "model", tmp_path / "comfy")
    run = train_from_files(tmp_path, config, model_keys(files), OMP_NUM_THREADS="1")
    assert_trains_as(run, hunyuan15_run)


@pytest.mark.slow
def test_i2v_component_files_train_as_the_folder(hunyuan15_i2v_run: Path, tiny_hunyuan15_i2v: Path, tmp_path) -> None:
    """The shared image-to-video run (the diffusers folder), again from ComfyUI files only, the SigLIP image encoder
    as ComfyUI's ``sigclip_vision_patch14_384`` file (without the pooling head) in ``text_encoders``: equal losses and
    LoRA files."""
    from test_hunyuan15_train import write_project

    config = write_project(tmp_path, "hunyuan-video-1.5-i2v", tiny_hunyuan15_i2v)
    files = comfy_files(tmp_path / "model", tmp_path / "comfy")
    siglip = {k: v for k, v in component_state(tmp_path / "model", "image_encoder").items() if not head(k)}
    files["text_encoders"].append(save(siglip, tmp_path / "comfy" / "sigclip_vision_patch14_384.safetensors"))
    run = train_from_files(tmp_path, config, model_keys(files), OMP_NUM_THREADS="1")
    assert_trains_as(run, hunyuan15_i2v_run)
