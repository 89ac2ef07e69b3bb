"""The plugin passes the core's conformance kit (an image batch with masks; its sample comparison runs
``Lumina2Pipeline`` on the tiny folder with its own scheduler, the prompt and negative prompt as strings). The kit
runs on the diffusers folder; the original-layout single file loads to the same weights and per stage as the folder
does (test_lumina_model)."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_lumina.plugin import plugin as lumina


def test_lumina2_plugin_conforms(tiny_lumina2: Path) -> None:
    table = {"type": "lumina2", "path": tiny_lumina2, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": 48}
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(lumina, "lumina2", table, pixels=pixels, captions=["a red cat", "a photo of a dog"])
