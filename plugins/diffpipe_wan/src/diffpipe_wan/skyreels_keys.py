"""The original key layout of the SkyReels V2 transformer: the original Wan layout (:mod:`diffpipe_wan.original`),
which is what the SkyReels-V2 checkpoints and ComfyUI use, plus the diffusion-forcing models' frame-rate embedding
(``inject_sample_info``): ``fps_embedding`` keeps its name, the SkyReels repository's ``fps_projection.0`` /
``fps_projection.2`` (``nn.Sequential(Linear, SiLU, Linear)``) are diffusers' ``fps_projection.net.0.proj`` /
``fps_projection.net.2``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from diffpipe_core.parts.layout import KeyTable
from diffpipe_wan import original

FPS_RENAMES = (
    ("fps_embedding", "fps_embedding"),
    ("fps_projection.0", "fps_projection.net.0.proj"),
    ("fps_projection.2", "fps_projection.net.2"),
)


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    """The table sized from a ``SkyReelsV2Transformer3DModel`` ``config.json``."""
    table = original.layout_for_config(config)
    return replace(table, name="original SkyReels V2 (Wan)", model="SkyReels V2 transformer",
                   renames=table.renames + FPS_RENAMES)  # fmt: skip


def lora_layout(state_dict: Mapping[str, Any]) -> KeyTable:
    """The table for a ComfyUI export of a LoRA (the blocks' modules: Wan's)."""
    return original.lora_layout(state_dict)
