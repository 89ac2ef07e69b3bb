"""SD3 from the files ComfyUI users keep (issue 35): ``sd3.5_medium.safetensors`` (Stability's MMDiT layout under
``model.diffusion_model.``), the VAE in the LDM layout, and ``clip_l.safetensors``, ``clip_g.safetensors`` and
``t5xxl_fp16.safetensors`` (transformers' names: which encoder each file holds is read from its tensors) beside a
folder of only configs and tokenizers: the weights load exactly as the folder's, an fp8 scaled transformer stays
quantized and loads per stage, and (slow) a run from the files trains as the shared run from the folder."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.anchor.keys import toml_key, toml_value
from diffpipe_core.parts.ldm import vae_table
from diffpipe_core.testing import runs
from diffpipe_core.testing.component_files import (
    assert_kept_quantized,
    assert_loads_as_the_folder,
    comfyui_files,
    quantize_file,
)
from diffpipe_sd3.original import layout_for_config
from diffpipe_sd3.plugin import plugin as sd3
from diffpipe_sd3.testing import tiny_config

ENCODERS = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")


def comfy_files(folder: Path, out: Path) -> dict:
    """``folder`` as ComfyUI component files under ``out`` and a config-only folder ``out/configs``; the text
    encoder files in reverse order (the order in a table says nothing)."""
    files = comfyui_files(folder, out, layout_for_config, partial(vae_table, prefix=""))
    files["text_encoders"] = files["text_encoders"][::-1]
    return files


@pytest.fixture(scope="module")
def comfy(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return comfy_files(tiny_sd3, tmp_path_factory.mktemp("comfy"))


def from_files(comfy: dict, **keys):
    given = {"diffusion_model": comfy["diffusion_model"], "vae": comfy["vae"], "text_encoders": comfy["text_encoders"]}
    return tiny_config(comfy["configs"], **{**given, **keys})


def test_component_files_load_exactly_the_folders_weights(tiny_sd3: Path, comfy: dict) -> None:
    cfg = from_files(comfy)
    lines = "\n".join(sd3.model_file_lines(cfg))
    assert "diffusion_model: " in lines and "Stability MMDiT layout" in lines
    assert f"vae: {comfy['vae']}: LDM layout" in lines
    for name, cls in (("text_encoder", "CLIPTextModelWithProjection"), ("text_encoder_3", "T5EncoderModel")):
        assert f"{name}: " in lines and f"({cls})" in lines
    assert_loads_as_the_folder(sd3, cfg, tiny_config(tiny_sd3), ENCODERS)


def test_a_quantized_transformer_stays_quantized(comfy: dict, tmp_path: Path) -> None:
    file = quantize_file(comfy["diffusion_model"], tmp_path / "sd3.5_medium_fp8_scaled.safetensors", "fp8_scaled")
    assert_kept_quantized(sd3, from_files(comfy, diffusion_model=file), from_files(comfy), torch.float8_e4m3fn)


@pytest.mark.slow
def test_component_files_train_as_the_folder(sd3_run: Path, tmp_path: Path) -> None:
    """The shared run of the diffusers folder (conftest's ``sd3_run``), again from ComfyUI files: equal losses and
    LoRA files."""
    from test_sd3_train import make_project

    root = make_project(tmp_path)
    files = comfy_files(root / "model", root / "comfy")
    keys = {
        "path": str(files["configs"]),
        "diffusion_model": str(files["diffusion_model"]),
        "vae": str(files["vae"]),
        "text_encoders": [str(p) for p in files["text_encoders"]],
    }
    given = "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in keys.items())
    config = root / "run.toml"
    config.write_text(config.read_text().replace('path = "model"\n', given))
    run = runs.train(root, config, 1, OMP_NUM_THREADS="1")
    assert runs.losses(run) == pytest.approx(runs.losses(sd3_run), rel=1e-6, abs=1e-7)
    for name in ("adapter_model.safetensors", "adapter_model.comfyui.safetensors"):
        got, want = load_file(str(run / "saved/final" / name)), load_file(str(sd3_run / "saved/final" / name))
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in got), name
