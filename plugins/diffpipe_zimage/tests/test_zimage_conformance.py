"""The plugin passes the core's conformance kit (an image batch with masks). The kit runs on the diffusers folder;
the original single file loads to the same weights and per stage as the folder does (test_zimage_model), so a
second kit run on it would add time and no check."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_zimage.plugin import plugin as zi


def test_zimage_plugin_conforms(tiny_zimage: Path) -> None:
    table = {"type": "z-image", "path": tiny_zimage, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": 24}
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(zi, "z-image", table, pixels=pixels, captions=["a red cat", "a photo of a dog"])
