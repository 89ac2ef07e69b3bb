"""The original Wan VACE key layout (the Wan repositories' ``VaceWanModel``, as ComfyUI's ``wan2.1_vace_*`` files ship
it), as a key table: Wan's (:mod:`diffpipe_wan.original`) and, for each VACE block ``vace_blocks.N.``, the same
block renames, ``before_proj`` = ``proj_in`` (block 0) and ``after_proj`` = ``proj_out``; ``vace_patch_embedding``
keeps its name (the renames of diffusers' ``convert_wan_transformer_to_diffusers`` for VACE).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module
from diffpipe_wan.original import BLOCK_MODULES, blocks_in, layout

VACE_MODULES = (*BLOCK_MODULES, ("before_proj", "proj_in"), ("after_proj", "proj_out"))


def vace_layout(num_layers: int, vace_blocks: int) -> KeyTable:
    """The table of a VACE transformer with ``num_layers`` blocks and ``vace_blocks`` VACE blocks."""
    base = layout(num_layers)
    modules = tuple(
        Module(f"vace_blocks.{i}.{orig}", (f"vace_blocks.{i}.{ours}",), params=None)
        for i in range(vace_blocks)
        for orig, ours in VACE_MODULES
    )
    renames = tuple(
        pair
        for i in range(vace_blocks)
        for pair in (
            (f"vace_blocks.{i}.self_attn", f"vace_blocks.{i}.attn1"),
            (f"vace_blocks.{i}.cross_attn", f"vace_blocks.{i}.attn2"),
            (f"vace_blocks.{i}.modulation", f"vace_blocks.{i}.scale_shift_table"),
        )
    )
    renames += (("vace_patch_embedding", "vace_patch_embedding"),)
    return replace(base, modules=base.modules + modules, renames=base.renames + renames, name="original Wan VACE",
                   model="Wan VACE transformer")


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    """The table sized from a diffusers ``config.json`` of ``WanVACETransformer3DModel``."""
    return vace_layout(int(config.get("num_layers", 40)), len(config.get("vace_layers", range(8))))


def lora_layout(state_dict: Mapping[str, Any]) -> KeyTable:
    """The table for a ComfyUI export of a peft LoRA ``state_dict`` (sized by the blocks its keys name)."""
    return vace_layout(blocks_in(k for k in state_dict if "vace_blocks." not in k), vace_blocks_in(state_dict))


def vace_blocks_in(keys: Iterable[str]) -> int:
    """``max(N) + 1`` over the ``vace_blocks.N.`` module paths in ``keys``."""
    found = {int(m.group(1)) for k in keys if (m := re.match(r"(?:.*\.)?vace_blocks\.(\d+)\.", k))}
    return max(found) + 1 if found else 0
