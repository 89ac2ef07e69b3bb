"""Issue 20.14: a model folder whose encoder exists only as a pickle ``.bin`` is refused by the plugin's
``validate_model_files`` (so by `diffpipe validate` and before any work): loading a pickle runs code. The check is
the core's (``diffpipe_core.model_files.check_component``), shared by every plugin; here on the tiny Flux."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from diffpipe_core.registry import get_registry


def test_an_encoder_saved_only_as_pickle_is_refused(tiny_flux: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_flux, tmp_path / "flux")
    plugin = get_registry().model("flux")
    cfg = plugin.spec.config_schema(type="flux", path=folder)
    assert plugin.call("validate_model_files", model_config=cfg) == []
    encoder = folder / "text_encoder_2"
    weights = encoder / "model.safetensors"
    torch.save(load_file(str(weights)), encoder / "pytorch_model.bin")  # how older checkpoints ship
    weights.unlink()
    problems = plugin.call("validate_model_files", model_config=cfg)
    assert len(problems) == 1 and problems[0].startswith(f"{encoder}: the text encoder 2's weights are only pickle "
                                                         "files (pytorch_model.bin)"), problems
