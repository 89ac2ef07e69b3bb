"""OmniGen2's single-file layout (the released ``transformer/`` shards and ComfyUI's ``omnigen2_fp16.safetensors``) as
a key table: ComfyUI's ``comfy/ldm/omnigen/omnigen2.py`` keeps every name of the reference model, which
:class:`~diffpipe_omnigen.model.OmniGen2Transformer2DModel` keeps too, so the table renames nothing
(``passthrough``). It serves the ``single_file`` export and the ComfyUI LoRA (``diffusion_model.<name>``, the generic
key form ComfyUI's ``model_lora_keys_unet`` accepts for every model, besides its Omnigen2 branch's bare names)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable

TABLE = KeyTable((), name="OmniGen2 (ComfyUI)", model="OmniGen2 transformer", passthrough=True)


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    """The table (the same for every size)."""
    return TABLE


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The table of a ComfyUI LoRA export."""
    return TABLE
