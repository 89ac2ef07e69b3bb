"""The plugin passes the core's conformance kit (an image batch with masks, non-square so the model pads its tokens;
its sample comparison runs ``HiDreamImagePipeline`` on the tiny folder with its own scheduler)."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_hidream.plugin import plugin as hidream


def test_hidream_plugin_conforms(tiny_hidream: Path) -> None:
    table = {"type": "hidream", "path": tiny_hidream, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": 16}
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(hidream, "hidream", table, pixels=pixels, captions=["a red cat", "a photo of a dog"])
