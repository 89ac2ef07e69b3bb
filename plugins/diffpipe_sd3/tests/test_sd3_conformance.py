"""The plugin passes the core's conformance kit (an image batch with masks; its sample comparison runs
``StableDiffusion3Pipeline`` on the tiny folder with its own scheduler). The kit runs on the diffusers folder; the
Stability-layout single file loads to the same weights and per stage as the folder does (test_sd3_model)."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_sd3.plugin import plugin as sd3


def test_sd3_plugin_conforms(tiny_sd3: Path) -> None:
    table = {"type": "sd3", "path": tiny_sd3, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 16}
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(sd3, "sd3", table, pixels=pixels, captions=["a red cat", "a photo of a dog"])
