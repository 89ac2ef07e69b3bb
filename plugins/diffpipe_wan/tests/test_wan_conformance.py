"""Issue test 5: every entry point passes the core's conformance kit (wan: a video batch and an image batch, with
masks; wan-i2v: clips with their first frames, sampled from a first frame; wan-flf2v: the same, sampled from a first
and a last frame; wan-ti2v: clips and images, sampled from a first frame), wan from the original-layout single
file of an A14B expert."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_core.testing.media import write_png
from diffpipe_wan.flf2v import wan_flf2v
from diffpipe_wan.i2v import wan_i2v
from diffpipe_wan.plugin import wan
from diffpipe_wan.testing import single_file_path
from diffpipe_wan.ti2v import wan_ti2v

TABLE = {"dtype": "float32", "encoder_dtype": "float32"}
CAPTIONS = ["a red cat", "a photo of a dog"]


def pixels(frames: int) -> torch.Tensor:
    return torch.rand(2, 3, frames, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1


def test_wan_conforms_as_an_a14b_expert_from_its_single_file(tiny_wan_a14b: Path) -> None:
    table = {"type": "wan", "path": tiny_wan_a14b, "expert": "low", "text_max_length": 8, **TABLE}
    table["diffusion_model"] = single_file_path(tiny_wan_a14b, "transformer_2")
    check_model_plugin(wan, "wan", table, pixels=pixels(5), captions=CAPTIONS)


def test_wan_i2v_conforms(tiny_wan_i2v: Path, tmp_path: Path) -> None:
    image = write_png(tmp_path / "first.png", 40, 24)
    table = {"type": "wan-i2v", "path": tiny_wan_i2v, "sample_image": image, **TABLE}
    check_model_plugin(wan_i2v, "wan-i2v", table, pixels=pixels(5), captions=CAPTIONS)


def test_wan_flf2v_conforms(tiny_wan_flf2v: Path, tmp_path: Path) -> None:
    first, last = write_png(tmp_path / "first.png", 40, 24), write_png(tmp_path / "last.png", 40, 24, seed=2)
    table = {"type": "wan-flf2v", "path": tiny_wan_flf2v, "sample_image": first, "sample_last_image": last, **TABLE}
    check_model_plugin(wan_flf2v, "wan-flf2v", table, pixels=pixels(5), captions=CAPTIONS)


def test_wan_ti2v_conforms(tiny_wan_ti2v: Path, tmp_path: Path) -> None:
    image = write_png(tmp_path / "first.png", 40, 24)
    table = {"type": "wan-ti2v", "path": tiny_wan_ti2v, "sample_image": image, "text_max_length": 8, **TABLE}
    check_model_plugin(wan_ti2v, "wan-ti2v", table, pixels=pixels(5), captions=CAPTIONS)
