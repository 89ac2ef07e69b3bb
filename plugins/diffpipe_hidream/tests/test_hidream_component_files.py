"""HiDream-I1 from the files ComfyUI users keep (issue 35): ``hidream_i1_full_fp16.safetensors`` (diffusers' names
under ``model.diffusion_model.``), FLUX.1's VAE in the LDM layout (the core's table), and ``clip_l_hidream``,
``clip_g_hidream``, ``t5xxl`` and ``llama_3.1_8b_instruct`` files (transformers' names: which encoder each file holds
is read from its tensors, the Llama file without its head) beside a folder of only configs and tokenizers: the
weights load exactly as the folder's; an fp8 scaled transformer stays quantized and its layers run."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffpipe_core.parts.ldm import vae_table
from diffpipe_core.testing.component_files import (
    assert_kept_quantized,
    assert_loads_as_the_folder,
    comfyui_files,
    quantize_file,
)
from diffpipe_hidream.original import layout_for_config
from diffpipe_hidream.plugin import plugin as hidream
from diffpipe_hidream.testing import tiny_config

ENCODERS = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")


@pytest.fixture(scope="module")
def comfy(tiny_hidream: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The folder as ComfyUI files (the text encoders in reverse order: the order says nothing)."""
    files = comfyui_files(tiny_hidream, tmp_path_factory.mktemp("comfy"), layout_for_config,
                          partial(vae_table, prefix=""))
    files["text_encoders"] = files["text_encoders"][::-1]
    return files


def from_files(comfy: dict, **keys):
    given = {"diffusion_model": comfy["diffusion_model"], "vae": comfy["vae"], "text_encoders": comfy["text_encoders"]}
    return tiny_config(comfy["configs"], **{**given, **keys})


def test_component_files_load_exactly_the_folders_weights(tiny_hidream: Path, comfy: dict) -> None:
    cfg = from_files(comfy)
    lines = "\n".join(hidream.model_file_lines(cfg))
    assert f"diffusion_model: {comfy['diffusion_model']}: diffusers (under 'model.diffusion_model')" in lines, lines
    for name, cls in (("text_encoder_2", "CLIPTextModelWithProjection"), ("text_encoder_4", "LlamaForCausalLM")):
        assert f"{name}: " in lines and f"({cls})" in lines
    assert_loads_as_the_folder(hidream, cfg, tiny_config(tiny_hidream), ENCODERS)
    # a Llama file of the language model alone (ComfyUI's: the head is never run for text) loads its layers the same
    headless = []
    for file in comfy["text_encoders"]:
        state = load_file(str(file))
        if any(k.startswith("lm_head.") for k in state):
            file = file.with_name("llama_3.1_8b_instruct.safetensors")
            save_file({k: v for k, v in state.items() if not k.startswith("lm_head.")}, str(file))
        headless.append(file)
    bare = from_files(comfy, text_encoders=headless)
    assert hidream.validate_model_files(bare) == []
    got = hidream.load_encoders(bare, torch.device("cpu")).text_encoder_4.state_dict()
    want = load_file(str(tiny_hidream / "text_encoder_4" / "model.safetensors"))
    language = [k for k in want if k.startswith("model.")]
    assert language and all(torch.equal(got[k], want[k]) for k in language)


def test_a_quantized_transformer_stays_quantized(comfy: dict, tmp_path: Path) -> None:
    file = quantize_file(comfy["diffusion_model"], tmp_path / "hidream_i1_full_fp8_scaled.safetensors", "fp8_scaled")
    model = assert_kept_quantized(hidream, from_files(comfy, diffusion_model=file), from_files(comfy),
                                  torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(0)  # the layers run on it: the compute dtype is not the stored weights'
    out = (torch.randn(1, 4, 4, 4, generator=g), torch.tensor([0.5]), torch.randn(1, 16, 32, generator=g),
           torch.randn(1, 3, 16, 24, generator=g), torch.randn(1, 48, generator=g))
    with torch.no_grad():
        for layer in hidream.split_into_layers(model.eval(), None):
            out = layer(out)
    assert out[0].shape == (1, 4, 4, 4) and out[0].isfinite().all()
