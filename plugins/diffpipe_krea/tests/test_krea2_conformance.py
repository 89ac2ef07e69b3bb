"""Krea 2 and its Turbo entry point pass the core's conformance kit (an image batch with masks, at a size in
multiples of 16 pixels)."""

from __future__ import annotations

import pytest
import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_krea.plugin import plugin, turbo


@pytest.mark.parametrize("name", ["krea2", "krea2-turbo"])
def test_krea2_plugins_conform(name: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue("tiny_krea2_turbo" if name.endswith("turbo") else "tiny_krea2")
    table = {"type": name, "path": path, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 16}
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(turbo if name.endswith("turbo") else plugin, name, table, pixels=pixels,
                       captions=["a red cat", "a photo of a dog"])
