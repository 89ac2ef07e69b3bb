"""The plugin passes the core's conformance kit (an image batch with masks), from both on-disk layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_zimage.plugin import plugin as zi
from diffpipe_zimage.testing import original_path


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_zimage_plugin_conforms(tiny_zimage: Path, layout: str) -> None:
    table = {"type": "z-image", "path": tiny_zimage, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": 24}
    if layout == "original":
        table["transformer_file"] = original_path(tiny_zimage)
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(zi, "z-image", table, pixels=pixels, captions=["a red cat", "a photo of a dog"])
