"""Ideogram 4 passes the core's conformance kit (an image batch with masks, at a size in multiples of 16 pixels)."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_ideogram.plugin import plugin


def test_ideogram4_plugin_conforms(tiny_ideogram4: Path) -> None:
    table = {"type": "ideogram4", "path": tiny_ideogram4, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": 32}
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(plugin, "ideogram4", table, pixels=pixels, captions=["a red cat", "a photo of a dog"])
