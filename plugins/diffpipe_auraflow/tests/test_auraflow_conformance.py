"""The plugin passes the core's conformance kit (an image batch with masks; its sample comparison runs
``AuraFlowPipeline`` on the tiny folder with its own scheduler). The kit runs on the diffusers folder; the
original-layout single file loads to the same weights and per stage as the folder does (test_auraflow_model)."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_auraflow.plugin import plugin as aura
from diffpipe_core.testing.conformance import check_model_plugin


def test_auraflow_plugin_conforms(tiny_auraflow: Path) -> None:
    table = {"type": "auraflow", "path": tiny_auraflow, "dtype": "float32", "encoder_dtype": "float32",
             "text_max_length": 16}
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(aura, "auraflow", table, pixels=pixels, captions=["a red cat", "a photo of a dog"])
