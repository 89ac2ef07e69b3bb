"""Chroma's original key layout (lodestones' checkpoints, as ComfyUI and diffusers' single-file converter read them) as
a table of diffusers modules: Flux.1's double and single blocks (:mod:`diffpipe_flux.bfl`'s block tables) without
their modulation linears, and the ``distilled_guidance_layer`` that computes every block's modulation. The plugin
names this module as its ``key_tables``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from diffpipe_core.parts.layout import SCALE_NORM, KeyTable, Module, count_blocks
from diffpipe_flux.bfl import double_attention, double_mlps, single_linears, single_norms

APPROXIMATOR = "distilled_guidance_layer"


def chroma_layout(num_double: int, num_single: int, approximator_layers: int, inner: int) -> KeyTable:
    """Chroma's original layout (lodestones' checkpoints, as ComfyUI loads them): Flux.1's blocks without their
    modulation linears (Chroma computes every modulation in one ``distilled_guidance_layer``), no timestep, guidance
    or pooled-vector MLPs, and a final layer without adaLN."""
    g = APPROXIMATOR
    modules = [
        Module("img_in", ("x_embedder",)),
        Module("txt_in", ("context_embedder",)),
        Module(f"{g}.in_proj", (f"{g}.in_proj",)),
        Module(f"{g}.out_proj", (f"{g}.out_proj",)),
    ]
    for i in range(approximator_layers):
        modules += [
            Module(f"{g}.layers.{i}.in_layer", (f"{g}.layers.{i}.linear_1",)),
            Module(f"{g}.layers.{i}.out_layer", (f"{g}.layers.{i}.linear_2",)),
            Module(f"{g}.norms.{i}", (f"{g}.norms.{i}",), params=SCALE_NORM, comfy=None),
        ]
    for i in range(num_double):
        b, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        modules += [*double_attention(b, d, (inner,) * 3), *double_mlps(b, d)]
    for i in range(num_single):
        b, d = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        modules += [*single_linears(b, d, inner), *single_norms(b, d)]
    modules.append(Module("final_layer.linear", ("proj_out",)))
    return KeyTable(tuple(modules), name="Chroma", model="Chroma transformer")


def inner_dim(config: Mapping[str, Any], heads: int = 24, head_dim: int = 128) -> int:
    """Heads x head dim of a transformer config."""
    return int(config.get("num_attention_heads", heads)) * int(config.get("attention_head_dim", head_dim))


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    """The Chroma table of a ``ChromaTransformer2DModel`` config (``transformer/config.json``)."""
    return chroma_layout(
        int(config.get("num_layers", 19)),
        int(config.get("num_single_layers", 38)),
        int(config.get("approximator_layers", 5)),
        inner_dim(config),
    )


def lora_inner_dim(state: Mapping[str, Any]) -> int:
    """The inner dim of a Chroma LoRA's model: the input width of its first adapted attention q/k/v (0 when none is
    adapted, and then no fused module needs it)."""
    pattern = re.compile(r"blocks\.\d+\.attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)\.lora_A")
    return next((int(v.shape[1]) for k, v in state.items() if pattern.search(k)), 0)


def lora_blocks(state: Mapping[str, Any]) -> tuple[int, int]:
    """Double and single blocks a LoRA's module names reach."""
    keys = list(state)
    return count_blocks(keys, r"transformer_blocks\.(\d+)\."), count_blocks(keys, r"single_transformer_blocks\.(\d+)\.")


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The table for a ComfyUI export of a peft LoRA of Chroma, sized from its module names and shapes."""
    approximator = count_blocks(list(state), r"distilled_guidance_layer\.layers\.(\d+)\.")
    return chroma_layout(*lora_blocks(state), approximator, lora_inner_dim(state))
