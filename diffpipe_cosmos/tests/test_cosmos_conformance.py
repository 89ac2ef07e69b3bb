"""Issue point 5: both entry points pass the core's conformance kit (which also compares per-stage loading with a
whole load). One layout each keeps the time down: 1.0 from the original file, Predict2 from the diffusers folder;
the other two combinations load per stage in the training runs (test_cosmos_train.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cosmos_common import PLUGINS

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_cosmos.testing import original_path


@pytest.mark.parametrize(("name", "layout"), [("cosmos", "original"), ("cosmos-predict2", "diffusers")])
def test_cosmos_plugins_conform(tiny_models: dict[str, Path], name: str, layout: str) -> None:
    folder = tiny_models[name]
    table = {"type": name, "path": folder, "dtype": "float32", "encoder_dtype": "float32", "t5_max_length": 16}
    if layout == "original":
        table["diffusion_model"] = original_path(folder)
    frames = 9 if name == "cosmos" else 5
    pixels = torch.rand(2, 3, frames, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(PLUGINS[name], name, table, pixels=pixels, captions=["a red cat", "a robot arm walking"])
