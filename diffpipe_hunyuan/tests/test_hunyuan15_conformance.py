"""The core's conformance kit passes for both HunyuanVideo-1.5 entry points (a video batch and an image batch, with
masks; image-to-video with the clips' first frames), text-to-video from Tencent's single file, image-to-video from
the folder (its samples from a sample image)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_hunyuan.i2v15 import plugin as i2v
from diffpipe_hunyuan.plugin15 import plugin as t2v
from diffpipe_hunyuan.testing15 import original_path


@pytest.mark.parametrize("name", ["hunyuan-video-1.5", "hunyuan-video-1.5-i2v"])
def test_hunyuan15_plugins_conform(
    name: str, tiny_hunyuan15: Path, tiny_hunyuan15_i2v: Path, crop_start15: int, tmp_path: Path
) -> None:
    plugin = i2v if name.endswith("i2v") else t2v
    table = {"type": name, "dtype": "float32", "encoder_dtype": "float32", "text_max_length": 8,
             "text_crop_start": crop_start15, "glyph_max_length": 8}
    if plugin is i2v:
        Image.fromarray(np.full((32, 32, 3), 90, dtype=np.uint8)).save(tmp_path / "first.png")
        table |= {"path": tiny_hunyuan15_i2v, "sample_image": tmp_path / "first.png"}
    else:
        table |= {"path": tiny_hunyuan15, "diffusion_model": original_path(tiny_hunyuan15)}
    pixels = torch.rand(2, 3, 5, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(plugin, name, table, pixels=pixels, captions=["a red cat", 'a sign saying "open"'])
