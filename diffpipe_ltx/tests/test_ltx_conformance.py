"""Issue point 6: the plugin passes the core's conformance kit, from both on-disk layouts (videos and images)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_ltx.plugin import plugin as ltx
from diffpipe_ltx.testing import single_file_path


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_ltx_plugin_conforms(tiny_ltx: Path, layout: str) -> None:
    table = {
        "type": "ltx-video",
        "path": tiny_ltx,
        "dtype": "float32",
        "encoder_dtype": "float32",
        "t5_max_length": 16,
        "first_frame_conditioning_p": 0.5,
    }
    if layout == "original":
        table["diffusion_model"] = single_file_path(tiny_ltx)
    pixels = torch.rand(2, 3, 9, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(ltx, "ltx-video", table, pixels=pixels, captions=["a red cat", "a photo of a dog"])
