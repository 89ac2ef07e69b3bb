"""Issue 9.6: a folder of another architecture is found by ``validate_model_files`` before any work, and
each problem names the file, what was expected and what was found. No weights are read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from diffpipe_core.registry import Registry
from diffpipe_flux.plugin import plugin as flux_plugin
from diffpipe_flux.testing import bfl_path


def _check(**keys) -> list[str]:
    registry = Registry()
    registry.register_model("flux", flux_plugin)
    plugin = registry.model("flux")
    return plugin.call("validate_model_files", model_config=plugin.spec.config_schema(type="flux", **keys))


def test_flux_folder_passes_and_other_architectures_are_named(tiny_flux: Path, tmp_path: Path) -> None:
    assert _check(path=tiny_flux) == []
    assert _check(path=tiny_flux, diffusion_model=bfl_path(tiny_flux)) == []

    sdxl = tmp_path / "sdxl"  # an SDXL folder's structure (its JSON files are all the check reads)
    (sdxl / "unet").mkdir(parents=True)
    (sdxl / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "StableDiffusionXLPipeline",
                "unet": ["diffusers", "UNet2DConditionModel"],
                "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
            }
        )
    )
    (problem,) = _check(path=sdxl)
    assert str(sdxl / "model_index.json") in problem
    assert "'StableDiffusionXLPipeline'" in problem and "'FluxPipeline'" in problem

    # A Flux folder whose second text encoder is a CLIP (the T5 would have been built from a CLIP config).
    wrong = tmp_path / "wrong"
    shutil.copytree(tiny_flux, wrong, ignore=shutil.ignore_patterns("*.safetensors"))
    config = wrong / "text_encoder_2" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "architectures": ["CLIPTextModel"]}))
    shutil.rmtree(wrong / "tokenizer_2")
    problems = _check(path=wrong)
    assert any(str(config) in p and "'CLIPTextModel'" in p and "'T5EncoderModel'" in p for p in problems), problems
    assert any(str(wrong / "tokenizer_2") in p and "missing" in p for p in problems), problems

    not_bfl = tmp_path / "not_bfl.safetensors"
    save_file({"down_blocks.0.weight": torch.zeros(1)}, str(not_bfl))
    (problem,) = _check(path=tiny_flux, diffusion_model=not_bfl)
    assert str(not_bfl) in problem and "double_blocks" in problem and "down_blocks.0.weight" in problem
