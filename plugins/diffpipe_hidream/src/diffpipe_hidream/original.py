"""HiDream-I1's single-file layout as ComfyUI loads it (``hidream_i1_full_fp16.safetensors``, ``..._dev_...``,
``..._fast_...``): ComfyUI's HiDream model (``comfy/ldm/hidream/model.py``) names every module as diffusers'
``HiDreamImageTransformer2DModel`` does (``double_stream_blocks.N.block.attn1.to_q``,
``single_stream_blocks.N.block.ff_i.experts.M.w1``, ``caption_projection.K.linear``), and ComfyUI's model detection
recognises the file by ``caption_projection.0.linear.weight``. So the table is the identity, read with or without
``model.diffusion_model.`` / ``diffusion_model.``; a ComfyUI LoRA is the peft modules under ``diffusion_model.`` with an
``.alpha`` each, the generic ``diffusion_model.<module>`` keys of ComfyUI's LoRA key map (``comfy/lora.py``; its
HiDream branch adds SimpleTuner's ``transformer.<module>`` and ``lycoris_`` names on top).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable

#: the key every HiDream-I1 file holds (what ComfyUI's model detection tests)
MARKER = "caption_projection.0.linear.weight"


def layout_for_config(config: Mapping[str, Any] | None = None) -> KeyTable:
    """The table (the same for every size of the model: every name is kept)."""
    return KeyTable((), name="HiDream (ComfyUI)", model="HiDream transformer", passthrough=True)


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The table for a ComfyUI export of a peft LoRA (``state``: its tensors): the identity."""
    return layout_for_config()


def diffusers_to_original(state: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers ``HiDreamImageTransformer2DModel`` state dict in ComfyUI's layout (the same keys)."""
    return layout_for_config(config).to_original(state)
