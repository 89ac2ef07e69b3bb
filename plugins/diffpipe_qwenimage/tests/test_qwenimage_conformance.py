"""Issue 23, test 4: both entry points pass the core's conformance kit (an image batch with masks), Qwen-Image from
both on-disk layouts."""

from __future__ import annotations

import pytest
import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_qwenimage.edit import plugin as edit
from diffpipe_qwenimage.plugin import plugin as qwen
from diffpipe_qwenimage.testing import comfy_path


@pytest.mark.parametrize("name", ["qwen-image", "qwen-image-comfyui", "qwen-image-edit"])
def test_qwen_plugins_conform(name: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue("tiny_edit_plus" if name == "qwen-image-edit" else "tiny_qwen")
    table = {"type": name, "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 16}
    if name == "qwen-image-comfyui":
        table.update(type="qwen-image", transformer_file=comfy_path(path))
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    plugin = edit if name == "qwen-image-edit" else qwen
    check_model_plugin(plugin, table["type"], table, pixels=pixels, captions=["a red cat", "a photo of a dog"])
