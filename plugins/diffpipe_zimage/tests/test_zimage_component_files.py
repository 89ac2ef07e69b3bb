"""Z-Image from the files ComfyUI users keep (issue 35): ``z_image_turbo_bf16.safetensors`` (the original layout under
``model.diffusion_model.``), ``ae.safetensors`` (Flux's VAE in the LDM layout) and ``qwen_3_4b.safetensors``
(Qwen3 under ComfyUI's ``model.``), beside a folder of only configs and tokenizers: the weights load exactly as the
folder's, an fp8 scaled transformer stays quantized and loads per stage, and (slow) a run from the files trains as
the shared run from the folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.anchor.keys import toml_key, toml_value
from diffpipe_core.parts.ldm import vae_table
from diffpipe_core.quantize import ScaledLinear
from diffpipe_core.registry import Registry
from diffpipe_core.testing import runs
from diffpipe_core.testing.component_files import (
    assert_same_state,
    config_only,
    quantizable_linears,
    quantize_file,
    write_component_files,
)
from diffpipe_core.testing.stage_reads import assert_stages_read_their_own
from diffpipe_zimage.original import layout_for_config
from diffpipe_zimage.plugin import plugin as zimage
from diffpipe_zimage.testing import tiny_config

CPU = torch.device("cpu")
QWEN_PREFIX = "model."  # ComfyUI's Qwen3-4B file: the language model under model.


def comfy_files(folder: Path, out: Path) -> dict:
    """``folder`` as ComfyUI component files under ``out`` and a config-only folder ``out/configs``."""
    config = json.loads((folder / "transformer" / "config.json").read_text())
    vae = json.loads((folder / "vae" / "config.json").read_text())
    files = write_component_files(
        folder, out, layout_for_config(config), vae_table(vae, ""), {"text_encoder": QWEN_PREFIX}
    )
    files["configs"] = config_only(folder, out / "configs")
    return files


@pytest.fixture(scope="module")
def comfy(tiny_zimage: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return comfy_files(tiny_zimage, tmp_path_factory.mktemp("comfy"))


def from_files(comfy: dict, **keys):
    given = {"diffusion_model": comfy["diffusion_model"], "vae": comfy["vae"], "text_encoders": comfy["text_encoders"]}
    return tiny_config(comfy["configs"], **{**given, **keys})


def test_component_files_load_exactly_the_folders_weights(tiny_zimage: Path, comfy: dict) -> None:
    cfg = from_files(comfy)
    assert zimage.validate_model_files(cfg) == []
    lines = "\n".join(zimage.model_file_lines(cfg))
    assert "diffusion_model: " in lines and "original Z-Image layout" in lines
    assert f"vae: {comfy['vae']}: LDM layout" in lines
    assert f"text_encoder: {comfy['text_encoders'][0]}: diffusers (under 'model')" in lines and "(Qwen3Model)" in lines
    folder = tiny_config(tiny_zimage)
    got, expected = zimage.load_encoders(cfg, CPU), zimage.load_encoders(folder, CPU)
    for name in ("vae", "text_encoder"):
        assert_same_state(getattr(got, name).state_dict(), getattr(expected, name).state_dict())
    for dtype in (torch.float32, torch.bfloat16):
        assert_same_state(
            zimage.load_diffusion_model(cfg, CPU, dtype).state_dict(),
            zimage.load_diffusion_model(folder, CPU, dtype).state_dict(),
        )


def test_a_quantized_transformer_stays_quantized(comfy: dict, tmp_path: Path) -> None:
    file = quantize_file(comfy["diffusion_model"], tmp_path / "z_image_turbo_fp8_scaled.safetensors", "fp8_scaled")
    cfg = from_files(comfy, diffusion_model=file)
    assert zimage.validate_model_files(cfg) == []
    model = zimage.load_diffusion_model(cfg, CPU, torch.bfloat16)
    kept = {n: m for n, m in model.named_modules() if isinstance(m, ScaledLinear)}
    plain = zimage.load_diffusion_model(from_files(comfy), CPU, torch.bfloat16)
    assert set(kept) == quantizable_linears(plain)  # q, k and v cut from their fused tensor each
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in kept.values())
    assert f"{len(kept)} linears kept quantized" in zimage.model_file_lines(cfg)[0]
    registry = Registry()
    assert registry.register_model("z-image", zimage).ok
    assert_stages_read_their_own(registry.model("z-image"), cfg)


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
        "text_encoders": [{"path": str(p), "type": "qwen_image"} for p in files["text_encoders"]],
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
