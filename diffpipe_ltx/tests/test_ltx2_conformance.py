"""LTX-2 passes the core's conformance kit (clips with their first frames, and images), from the original single file
(the shared run and the loading tests cover the diffusers folder)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_ltx.ltx2 import ltx2
from diffpipe_ltx.ltx2_testing import single_file_path


@pytest.mark.parametrize("layout", ["original"])
def test_ltx2_plugin_conforms(tiny_ltx2: Path, layout: str) -> None:
    table = {"type": "ltx-2", "path": tiny_ltx2, "dtype": "float32", "encoder_dtype": "float32",
             "max_sequence_length": 16, "first_frame_conditioning_p": 0.5}
    if layout == "original":
        table["diffusion_model"] = single_file_path(tiny_ltx2)
    pixels = torch.rand(2, 3, 9, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(ltx2, "ltx-2", table, pixels=pixels, captions=["a red cat", "a photo of a dog"])
