"""Issue 9.6: ``validate_model_files`` accepts the SDXL folder and single file and names what does not fit,
without reading weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from diffpipe_core.registry import Registry
from diffpipe_sdxl.plugin import plugin as sdxl_plugin


def _check(**keys) -> list[str]:
    registry = Registry()
    registry.register_model("sdxl", sdxl_plugin)
    plugin = registry.model("sdxl")
    return plugin.call("validate_model_files", model_config=plugin.spec.config_schema(type="sdxl", **keys))


def test_sdxl_files_pass_and_a_flux_folder_or_file_is_named(tiny_sdxl: tuple[Path, Path], tmp_path: Path) -> None:
    folder, single = tiny_sdxl
    assert _check(path=folder) == []
    assert _check(path=single, config_path=folder) == []

    flux = tmp_path / "flux"
    (flux / "transformer").mkdir(parents=True)
    (flux / "model_index.json").write_text(json.dumps(
        {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}))
    (problem,) = _check(path=flux)
    assert str(flux / "model_index.json") in problem and "'FluxPipeline'" in problem
    assert "'StableDiffusionXLPipeline'" in problem

    bfl = tmp_path / "flux1-dev.safetensors"
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(1)}, str(bfl))
    (problem,) = _check(path=bfl, config_path=folder)
    assert str(bfl) in problem and "model.diffusion_model." in problem and "double_blocks" in problem

    (problem,) = _check(path=folder, vae_path=folder / "text_encoder")
    assert str(folder / "text_encoder" / "config.json") in problem and "'AutoencoderKL'" in problem
