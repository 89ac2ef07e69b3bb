"""Issue point 5: the plugin passes the core's conformance kit (a video batch and an image batch, with masks),
from both on-disk layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_hunyuan.plugin import plugin as hy
from diffpipe_hunyuan.testing import original_path


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_hunyuan_plugin_conforms(tiny_hunyuan: Path, crop_start: int, layout: str) -> None:
    table = {
        "type": "hunyuan-video",
        "path": tiny_hunyuan,
        "dtype": "float32",
        "encoder_dtype": "float32",
        "text_max_length": 8,
        "text_crop_start": crop_start,
    }
    if layout == "original":
        table["diffusion_model"] = original_path(tiny_hunyuan)
    pixels = torch.rand(2, 3, 5, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(hy, "hunyuan-video", table, pixels=pixels, captions=["a red cat", "a photo of a dog"])
