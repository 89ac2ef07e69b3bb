"""Ideogram 4's original key layout (Ideogram's checkpoints, ``ideogram4_fp8_scaled.safetensors`` as ComfyUI loads it:
its ``comfy/ldm/ideogram4`` model uses these names) as a table of diffusers modules.

The two layouts name every module alike but the attention: ComfyUI's ``attention.qkv`` is diffusers'
``attention.to_q | to_k | to_v`` stacked along the output rows, ``attention.o`` is ``attention.to_out.0``. The
block's ``feed_forward.w1/w2/w3``, ``adaln_modulation``, its four RMS norms and the q/k norms, and the embedders
(``input_proj``, ``llm_cond_norm`` / ``llm_cond_proj``, ``t_embedding.mlp_in/out``, ``adaln_proj``,
``embed_image_indicator``) and ``final_layer.*`` keep their names. ComfyUI's LoRA key map takes
``diffusion_model.<name>`` of these weights; diffusers' Ideogram 4 LoRA loader converts that layout too
(``_convert_non_diffusers_ideogram4_lora_to_diffusers``: ``attention.qkv`` split into thirds, ``attention.o``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module, count_blocks

WEIGHT = (("weight", "weight"),)
#: a block's modules whose names both layouts share
SAME_LINEARS = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "adaln_modulation")
SAME_NORMS = ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2", "attention.norm_q", "attention.norm_k")


def same(name: str, params: tuple[tuple[str, str], ...] | None = None, comfy: bool = True) -> Module:
    """A module both layouts name ``name`` (a linear unless ``params`` say otherwise)."""
    if params is None:
        return Module(name, (name,))
    return Module(name, (name,), params=params, comfy="=" if comfy else None)


def layout(num_layers: int, hidden: int = 0) -> KeyTable:
    """Every module of an Ideogram 4 transformer of ``num_layers`` blocks (``hidden``: the width, for the fused qkv's
    parts; 0: equal thirds)."""
    modules = [same(n) for n in ("input_proj", "llm_cond_proj", "t_embedding.mlp_in", "t_embedding.mlp_out",
                                 "adaln_proj", "final_layer.linear", "final_layer.adaln_modulation")]
    modules += [same("llm_cond_norm", WEIGHT, comfy=False), same("embed_image_indicator", WEIGHT, comfy=False)]
    for i in range(num_layers):
        b = f"layers.{i}"
        q, k, v = (f"{b}.attention.to_{x}" for x in "qkv")
        modules.append(Module(f"{b}.attention.qkv", (q, k, v), (hidden,) * 3 if hidden else ()))
        modules.append(Module(f"{b}.attention.o", (f"{b}.attention.to_out.0",)))
        modules += [same(f"{b}.{n}") for n in SAME_LINEARS]
        modules += [same(f"{b}.{n}", WEIGHT, comfy=False) for n in SAME_NORMS]
    return KeyTable(tuple(modules), name="Ideogram 4 (ComfyUI)", model="Ideogram 4 transformer")


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    """The table of the transformer ``config`` (``transformer/config.json``) describes."""
    hidden = int(config.get("attention_head_dim", 256)) * int(config.get("num_attention_heads", 18))
    return layout(int(config.get("num_layers", 34)), hidden)


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The table for a ComfyUI export of a peft LoRA (blocks counted from its module names)."""
    return layout(count_blocks(list(state), r"(?:.*\.)?layers\.(\d+)\."))
