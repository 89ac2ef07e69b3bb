"""Lumina 2 from the files diffusion-pipe's Lumina 2 example names, which ComfyUI loads (issue 35):
``lumina_2_model_bf16.safetensors`` (the original layout under ``model.diffusion_model.``),
``gemma_2_2b_fp16.safetensors`` (Gemma 2 under ComfyUI's ``model.``) and ``flux_vae.safetensors`` (Flux's VAE in the
LDM layout) beside a folder of only configs and the tokenizer: the weights load exactly as the folder's, the
architecture is read from the file's tensors, an fp8 scaled transformer stays quantized and loads per stage."""

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
from diffpipe_lumina.original import layout_for_config
from diffpipe_lumina.plugin import plugin as lumina
from diffpipe_lumina.testing import tiny_config

GEMMA_PREFIX = "model."  # ComfyUI's gemma_2_2b file: the language model under model.


@pytest.fixture(scope="module")
def comfy(tiny_lumina2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("comfy")
    return comfyui_files(tiny_lumina2, out, layout_for_config, partial(vae_table, prefix=""),
                         {"text_encoder": GEMMA_PREFIX})


def from_files(comfy: dict, **keys):
    given = {"diffusion_model": comfy["diffusion_model"], "vae": comfy["vae"], "text_encoders": comfy["text_encoders"]}
    return tiny_config(comfy["configs"], **{**given, **keys})


def test_component_files_load_exactly_the_folders_weights(tiny_lumina2: Path, comfy: dict) -> None:
    cfg = from_files(comfy)
    lines = "\n".join(lumina.model_file_lines(cfg))
    assert "diffusion_model: " in lines and "original Lumina 2 layout" in lines
    assert f"vae: {comfy['vae']}: LDM layout" in lines
    assert f"text_encoder: {comfy['text_encoders'][0]}: diffusers (under 'model')" in lines and "(Gemma2Model)" in lines
    assert_loads_as_the_folder(lumina, cfg, tiny_config(tiny_lumina2), ("vae", "text_encoder"))


def test_the_architecture_is_read_from_the_files_tensors(tiny_lumina2: Path, tmp_path: Path) -> None:
    """A file of 3 main and 1 refiner blocks, 48 wide in 3 heads, beside the tiny folder's config (2, 2, 32, 2)."""
    changes = {"num_layers": 3, "num_refiner_layers": 1, "hidden_size": 48, "num_attention_heads": 3}
    variant = variant_model(lumina, tiny_lumina2, **changes)
    file = variant_file(lumina, variant, tmp_path / "lumina_2_variant.safetensors")
    assert_variant_loads_as_itself(lumina, tiny_config(tiny_lumina2, diffusion_model=file), variant, changes)


def test_a_quantized_transformer_stays_quantized(comfy: dict, tmp_path: Path) -> None:
    file = quantize_file(comfy["diffusion_model"], tmp_path / "lumina_2_fp8_scaled.safetensors", "fp8_scaled")
    assert_kept_quantized(lumina, from_files(comfy, diffusion_model=file), from_files(comfy), torch.float8_e4m3fn)
