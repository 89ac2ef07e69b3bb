"""LTX-2 and LTX-2.5 pass the core's conformance kit (clips with their first frames, and images), from the original
single file (the shared runs and the loading tests cover the diffusers folders); LTX-2.5's folder is an
``LTX25ModularPipeline`` folder and its transformer LTX-2.3's layout (the LTX-2.3 run covers ``ltx-2.3``)."""

from __future__ import annotations

import pytest
import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_ltx.ltx2 import ltx2
from diffpipe_ltx.ltx2_testing import single_file_path
from diffpipe_ltx.ltx23 import ltx25

PLUGINS = {"ltx-2": (ltx2, "tiny_ltx2"), "ltx-2.5": (ltx25, "tiny_ltx25")}


@pytest.mark.parametrize("name", list(PLUGINS))
def test_ltx2_plugin_conforms(name: str, request: pytest.FixtureRequest) -> None:
    plugin, fixture = PLUGINS[name]
    folder = request.getfixturevalue(fixture)
    table = {"type": name, "path": folder, "dtype": "float32", "encoder_dtype": "float32",
             "max_sequence_length": 16, "first_frame_conditioning_p": 0.5, "diffusion_model": single_file_path(folder)}
    pixels = torch.rand(2, 3, 9, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(plugin, name, table, pixels=pixels, captions=["a red cat", "a photo of a dog"])
