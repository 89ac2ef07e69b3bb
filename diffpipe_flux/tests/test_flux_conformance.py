"""Issue point 5: the plugin passes the core's conformance kit, from both on-disk layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_flux.plugin import plugin as flux
from diffpipe_flux.testing import bfl_path


@pytest.mark.parametrize("layout", ["diffusers", "bfl"])
def test_flux_plugin_conforms(tiny_flux: Path, layout: str) -> None:
    table = {"type": "flux", "path": tiny_flux, "dtype": "float32", "encoder_dtype": "float32", "t5_max_length": 16}
    if layout == "bfl":
        table["diffusion_model"] = bfl_path(tiny_flux)
    check_model_plugin(
        flux, "flux", table, pixels=torch.rand(2, 3, 32, 48) * 2 - 1, captions=["a red cat", "a photo of a dog"]
    )
