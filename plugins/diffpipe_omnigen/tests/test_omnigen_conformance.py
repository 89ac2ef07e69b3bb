"""The plugin passes the core's conformance kit (an image batch with masks). OmniGen2 has no diffusers pipeline, so the
kit's sample comparison has nothing to run; the samples are compared with the reference pipeline's loop in
test_omnigen_reference."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_omnigen.plugin import plugin as omnigen


def test_omnigen2_plugin_conforms(tiny_omnigen2: Path) -> None:
    table = {"type": "omnigen2", "path": tiny_omnigen2, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": 64}
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(omnigen, "omnigen2", table, pixels=pixels, captions=["a red cat", "a photo of a dog"])
