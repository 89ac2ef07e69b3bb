"""Qwen-Image 2.1 and its Turbo entry point pass the core's conformance kit (an image batch with masks, at a size in
multiples of 32 pixels)."""

from __future__ import annotations

import pytest
import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_qwenimage.qwen21 import plugin, turbo


@pytest.mark.parametrize("name", ["qwen-image-2.1", "qwen-image-2.1-turbo"])
def test_qwen21_plugins_conform(name: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue("tiny_qwen21_turbo" if name.endswith("turbo") else "tiny_qwen21")
    table = {"type": name, "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 16}
    pixels = torch.rand(2, 3, 32, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(turbo if name.endswith("turbo") else plugin, name, table, pixels=pixels,
                       captions=["a red cat", "a photo of a dog"])
