"""OmniGen2 from the files ComfyUI users keep: ``omnigen2_fp16.safetensors`` (the transformer's own names under
``model.diffusion_model.``), ``ae.safetensors`` (FLUX.1's VAE in the LDM layout) and ``qwen_2.5_vl_fp16.safetensors``
(Qwen2.5-VL as ComfyUI holds it: ``model.*``, ``visual.*``, ``lm_head``) beside a folder of only configs, the
processor and the scheduler: the weights load exactly as the folder's (the text encoder is the folder's ``mllm``);
the architecture is read from the file's tensors; an fp8 scaled transformer stays quantized."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from diffpipe_core.parts.ldm import vae_table
from diffpipe_core.testing.component_files import (
    assert_kept_quantized,
    assert_loads_as_the_folder,
    assert_variant_loads_as_itself,
    comfyui_files,
    quantize_file,
    variant_file,
    variant_model,
)
from diffpipe_omnigen.original import layout_for_config
from diffpipe_omnigen.plugin import plugin as omnigen
from diffpipe_omnigen.testing import tiny_config


@pytest.fixture(scope="module")
def comfy(tiny_omnigen2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return comfyui_files(tiny_omnigen2, tmp_path_factory.mktemp("comfy"), layout_for_config,
                         partial(vae_table, prefix=""), text_components=("mllm",))


def from_files(comfy: dict, **keys):
    given = {"diffusion_model": comfy["diffusion_model"], "vae": comfy["vae"], "text_encoders": comfy["text_encoders"]}
    return tiny_config(comfy["configs"], **{**given, **keys})


def test_component_files_load_exactly_the_folders_weights(tiny_omnigen2: Path, comfy: dict) -> None:
    cfg = from_files(comfy)
    lines = "\n".join(omnigen.model_file_lines(cfg))
    assert f"vae: {comfy['vae']}: LDM layout" in lines
    assert f"mllm: {comfy['text_encoders'][0]}" in lines and "Qwen2_5_VLForConditionalGeneration" in lines, lines
    assert_loads_as_the_folder(omnigen, cfg, tiny_config(tiny_omnigen2), ("vae", "mllm"))


def test_the_architecture_is_read_from_the_files_tensors(tiny_omnigen2: Path, tmp_path: Path) -> None:
    """A file of 3 main and 2 refiner blocks, 48 wide in 3 heads, beside the tiny folder's config (2, 1, 32, 2)."""
    changes = {"num_layers": 3, "num_refiner_layers": 2, "hidden_size": 48, "num_attention_heads": 3}
    variant = variant_model(omnigen, tiny_omnigen2, **changes)
    file = variant_file(omnigen, variant, tmp_path / "omnigen2_variant.safetensors")
    assert_variant_loads_as_itself(omnigen, tiny_config(tiny_omnigen2, diffusion_model=file), variant, changes)


def test_a_quantized_transformer_stays_quantized(comfy: dict, tmp_path: Path) -> None:
    file = quantize_file(comfy["diffusion_model"], tmp_path / "omnigen2_fp8_scaled.safetensors", "fp8_scaled")
    assert_kept_quantized(omnigen, from_files(comfy, diffusion_model=file), from_files(comfy), torch.float8_e4m3fn)
