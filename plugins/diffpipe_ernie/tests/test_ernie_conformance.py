"""The plugin passes the core's conformance kit (an image batch with masks; samples against ErnieImagePipeline with
the folder's own scheduler). ComfyUI's single file loads the folder's weights per stage (test_ernie_model), so a
second kit run on it would add time and no check."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_ernie.plugin import plugin as ernie


def test_ernie_plugin_conforms(tiny_ernie: Path) -> None:
    table = {"type": "ernie-image", "path": tiny_ernie, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": 24}
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(ernie, "ernie-image", table, pixels=pixels, captions=["a red cat", "a photo of a dog"])
