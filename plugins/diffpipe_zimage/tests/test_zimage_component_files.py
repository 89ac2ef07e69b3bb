"""Z-Image from the files ComfyUI users keep (issue 35): ``z_image_turbo_bf16.safetensors`` (the original layout under
``model.diffusion_model.``), ``ae.safetensors`` (Flux's VAE in the LDM layout) and ``qwen_3_4b.safetensors``
(Qwen3 under ComfyUI's ``model.``), beside a folder of only configs and tokenizers: the weights load exactly as the
folder's, an fp8 scaled transformer stays quantized and loads per stage, and (slow) a run from the files trains as
the shared run from the folder."""

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
    assert_variant_loads_as_itself,
    comfyui_files,
    quantize_file,
    variant_file,
    variant_model,
)
from diffpipe_zimage.original import layout_for_config
from diffpipe_zimage.plugin import plugin as zimage
from diffpipe_zimage.testing import tiny_config

QWEN_PREFIX = "model."  # ComfyUI's Qwen3-4B file: the language model under model.


def comfy_files(folder: Path, out: Path) -> dict:
    """``folder`` as ComfyUI component files under ``out`` and a config-only folder ``out/configs``."""
    return comfyui_files(folder, out, layout_for_config, partial(vae_table, prefix=""), {"text_encoder": QWEN_PREFIX})


@pytest.fixture(scope="module")
def comfy(tiny_zimage: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return comfy_files(tiny_zimage, tmp_path_factory.mktemp("comfy"))


def from_files(comfy: dict, **keys):
    given = {"diffusion_model": comfy["diffusion_model"], "vae": comfy["vae"], "text_encoders": comfy["text_encoders"]}
    return tiny_config(comfy["configs"], **{**given, **keys})


def test_component_files_load_exactly_the_folders_weights(tiny_zimage: Path, comfy: dict) -> None:
    cfg = from_files(comfy)
    lines = "\n".join(zimage.model_file_lines(cfg))
    assert "diffusion_model: " in lines and "original Z-Image layout" in lines
    assert f"vae: {comfy['vae']}: LDM layout" in lines
    assert f"text_encoder: {comfy['text_encoders'][0]}: diffusers (under 'model')" in lines and "(Qwen3Model)" in lines
    assert_loads_as_the_folder(zimage, cfg, tiny_config(tiny_zimage), ("vae", "text_encoder"))


def test_a_quantized_transformer_stays_quantized(comfy: dict, tmp_path: Path) -> None:
    file = quantize_file(comfy["diffusion_model"], tmp_path / "z_image_turbo_fp8_scaled.safetensors", "fp8_scaled")
    assert_kept_quantized(zimage, from_files(comfy, diffusion_model=file), from_files(comfy), torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------- training


@pytest.mark.slow
def test_component_files_train_as_the_folder(zimage_run: Path, tmp_path: Path) -> None:
    """The shared run of the diffusers folder (conftest's ``zimage_run``), again from ComfyUI files: equal losses
    and LoRA files."""
    from test_zimage_train import make_project

    root = make_project(tmp_path)
    files = comfy_files(root / "model", root / "comfy")
    keys = {
        "path": str(files["configs"]),
        "diffusion_model": str(files["diffusion_model"]),
        "vae": str(files["vae"]),
        "text_encoders": [{"path": str(p), "type": "lumina2"} for p in files["text_encoders"]],
    }
    given = "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in keys.items())
    config = root / "run.toml"
    config.write_text(config.read_text().replace('path = "model"\n', given))
    run = runs.train(root, config, 1, OMP_NUM_THREADS="1")
    assert runs.losses(run) == pytest.approx(runs.losses(zimage_run), rel=1e-6, abs=1e-7)
    for name in ("adapter_model.safetensors", "adapter_model.comfyui.safetensors"):
        got, want = load_file(str(run / "saved/final" / name)), load_file(str(zimage_run / "saved/final" / name))
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in got), name


def test_a_file_of_another_variant_loads_as_itself(comfy: dict, tmp_path: Path) -> None:
    """Other block counts, width and heads than the folder's config: read from the file's tensors (the heads from the
    width and the per-head norm's size)."""
    read = {"n_layers": 1, "n_refiner_layers": 1, "dim": 48, "n_heads": 3, "n_kv_heads": 3}
    variant = variant_model(zimage, comfy["configs"], **read)
    file = variant_file(zimage, variant, tmp_path / "z_image.safetensors")
    assert_variant_loads_as_itself(zimage, from_files(comfy, diffusion_model=file), variant, read)
