"""HunyuanImage-2.1 from the files ComfyUI users keep: the transformer in Tencent's layout
(``hunyuanimage2.1.safetensors``, q, k, v fused) or ComfyUI's names (``img_attn.qkv``, ``time_in.in_layer``, under
``model.diffusion_model.``), ``hunyuan_image_2.1_vae_fp16.safetensors`` (Tencent's VAE layout, ComfyUI's
``encoder.down.i.block.j``), ``qwen_2.5_vl_7b.safetensors`` (ComfyUI's ``model.*`` / ``visual.*`` / ``lm_head``) and
``byt5_small_glyphxl_fp16.safetensors`` (T5 names), beside a folder of only configs and tokenizers: the weights load
exactly as the folder's; fp8 scaled and int8 transformers stay quantized; a file of another size is read as itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.schema import validate
from diffpipe_core.testing.component_files import (
    assert_kept_quantized,
    assert_loads_as_the_folder,
    assert_same_state,
    assert_variant_loads_as_itself,
    comfyui_files,
    quantize_file,
    variant_file,
    variant_model,
)
from diffpipe_hunyuan.config import HunyuanImage21Config
from diffpipe_hunyuan.image21 import plugin
from diffpipe_hunyuan.original21 import layouts_for_config
from diffpipe_hunyuan.testing21 import original_path
from diffpipe_hunyuan.vae_layouts import vae21_table

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def comfy(tiny_hunyuan_image: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny folder as ComfyUI files: the transformer in ComfyUI's names, the VAE in Tencent's layout."""
    out = tmp_path_factory.mktemp("comfy")
    return comfyui_files(tiny_hunyuan_image, out, lambda c: layouts_for_config(c)[1], vae21_table, {})


def config(path: Path, **keys) -> HunyuanImage21Config:
    table = {"type": "hunyuan-image-2.1", "path": path, "dtype": "float32", "encoder_dtype": "float32"}
    return validate(HunyuanImage21Config, {**table, "text_max_length": 16, "glyph_max_length": 8, **keys}, "test")


def files_of(comfy: dict, **keys) -> dict:
    """The ``[model]`` file keys, the ByT5 file first: which encoder each holds is read from its tensors."""
    return {"diffusion_model": comfy["diffusion_model"], "vae": comfy["vae"],
            "text_encoders": comfy["text_encoders"][::-1], **keys}


def test_component_files_load_exactly_the_folders_weights(tiny_hunyuan_image: Path, comfy: dict) -> None:
    keys = set(load_file(str(comfy["diffusion_model"])))
    assert {"model.diffusion_model.double_blocks.0.img_attn.qkv.weight",
            "model.diffusion_model.time_in.in_layer.weight", "model.diffusion_model.byt5_in.fc1.weight"} <= keys
    assert "encoder.down.0.block.0.conv1.weight" in load_file(str(comfy["vae"]))
    cfg = config(comfy["configs"], **files_of(comfy))
    lines = "\n".join(plugin.model_file_lines(cfg))
    assert "ComfyUI layout" in lines and f"vae: {comfy['vae']}: original Tencent layout" in lines
    assert "(AutoencoderKLHunyuanImage)" in lines and "(T5EncoderModel)" in lines
    folder = config(tiny_hunyuan_image)
    assert_loads_as_the_folder(plugin, cfg, folder, ("vae", "text_encoder", "text_encoder_2"))
    # Tencent's own file (q, k, v fused under Tencent's names) over the same configs
    tencent = config(comfy["configs"], **files_of(comfy, diffusion_model=original_path(tiny_hunyuan_image)))
    assert "original Tencent layout" in plugin.model_file_lines(tencent)[0]
    assert_same_state(plugin.load_diffusion_model(tencent, CPU, torch.float32).state_dict(),
                      plugin.load_diffusion_model(folder, CPU, torch.float32).state_dict())


@pytest.mark.parametrize(("form", "storage"), [("fp8_scaled", torch.float8_e4m3fn), ("int8_convrot", torch.int8)])
def test_a_quantized_transformer_stays_quantized(comfy: dict, tmp_path: Path, form: str, storage) -> None:
    file = quantize_file(comfy["diffusion_model"], tmp_path / f"hunyuanimage2.1_{form}.safetensors", form)
    model = assert_kept_quantized(plugin, config(comfy["configs"], **files_of(comfy, diffusion_model=file)),
                                  config(comfy["configs"], **files_of(comfy)), storage)
    g = torch.Generator().manual_seed(0)  # the layers run on it: the compute dtype is not the stored weights'
    from diffpipe_hunyuan import layers21

    out = (torch.randn(1, 8, 2, 2, generator=g), torch.tensor([0.5]), torch.randn(1, 3, 32, generator=g),
           torch.ones(1, 3, dtype=torch.bool), torch.randn(1, 2, 32, generator=g), torch.ones(1, 2, dtype=torch.bool),
           torch.tensor([3.25]), torch.tensor([0.5]))
    with torch.no_grad():
        for layer in layers21.split_into_layers(model):
            out = layer(out)
    assert out[0].shape == (1, 8, 2, 2) and out[0].isfinite().all()


def test_a_file_of_another_size_loads_as_itself(comfy: dict, tmp_path: Path) -> None:
    """Other block counts and heads than the folder's config (and the distilled embedders): read from the file."""
    read = {"num_layers": 2, "num_single_layers": 1, "num_attention_heads": 3, "guidance_embeds": True,
            "use_meanflow": True}
    variant = variant_model(plugin, comfy["configs"], **read)
    file = variant_file(plugin, variant, tmp_path / "hunyuanimage2.1-distilled.safetensors")
    assert_variant_loads_as_itself(plugin, config(comfy["configs"], **files_of(comfy, diffusion_model=file)), variant,
                                   read)


def test_full_model_exports_load_back(tiny_hunyuan_image: Path, tmp_path: Path) -> None:
    """A full fine-tune's shards export as a diffusers ``transformer`` folder and as one file in Tencent's layout
    (``hunyuanimage2.1.safetensors``'s names), and both load back to the fine-tuned weights."""
    from diffusers import HunyuanImageTransformer2DModel

    from diffpipe_core.testing import runs

    model = plugin.load_diffusion_model(config(tiny_hunyuan_image), CPU, torch.float32)
    with torch.no_grad():  # "fine-tuned"
        model.transformer_blocks[0].attn.add_k_proj.weight.add_(1.0)
        model.single_transformer_blocks[1].proj_mlp.bias.add_(1.0)
        model.norm_out.linear.weight[:4].add_(1.0)  # the final adaLN's first half: swapped in Tencent's layout
    saved = tmp_path / "saved"
    state = runs.export_full_finetune(plugin, model, config(tiny_hunyuan_image), saved)
    single = saved / "single_file" / plugin.single_file_name
    assert "double_blocks.0.txt_attn_qkv.weight" in load_file(str(single))
    from_single = plugin.load_diffusion_model(config(tiny_hunyuan_image, diffusion_model=single), CPU, torch.float32)
    from_folder = HunyuanImageTransformer2DModel.from_pretrained(str(saved / "diffusers"))
    assert_same_state(from_single.state_dict(), state)
    assert_same_state(from_folder.state_dict(), state)
