"""The plugin passes the core's conformance kit (a 22-frame clip batch with masks and its first frame as images:
encoding, whole and per-stage loading, the layers' stage boundaries, LoRA gradients, samples of the clip's size and
frame count: 22, the fewest the video VAE decodes). Samples against the modular pipeline are compared in
test_minimax_sampling."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_minimax.plugin import plugin as minimax


def test_minimax_plugin_conforms(tiny_minimax: Path) -> None:
    table = {"type": "minimax-h3", "path": tiny_minimax, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": 16}
    pixels = torch.rand(2, 3, 22, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(minimax, "minimax-h3", table, pixels=pixels, captions=["a red cat", "a red cat on the grass"])
