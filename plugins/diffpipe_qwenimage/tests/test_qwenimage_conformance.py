"""Issue 23, test 4: both entry points pass the core's conformance kit (an image batch with masks); the single-file
layout is checked in ``test_qwenimage_model.py`` (same weights, per-stage reads)."""

from __future__ import annotations

import pytest
import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_qwenimage.edit import plugin as edit
from diffpipe_qwenimage.plugin import plugin as qwen


@pytest.mark.parametrize("name", ["qwen-image", "qwen-image-edit"])
def test_qwen_plugins_conform(name: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue("tiny_edit_plus" if name == "qwen-image-edit" else "tiny_qwen")
    table = {"type": name, "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 16}
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    plugin = edit if name == "qwen-image-edit" else qwen
    check_model_plugin(plugin, table["type"], table, pixels=pixels, captions=["a red cat", "a photo of a dog"])
