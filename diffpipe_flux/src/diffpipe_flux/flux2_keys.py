"""FLUX.2's original key layout (Black Forest Labs' checkpoints, as ComfyUI loads them and diffusers'
``convert_flux2_transformer_checkpoint_to_diffusers`` reads them) as a table of diffusers modules.

Flux.1's double-block attention names (:func:`diffpipe_flux.bfl.double_attention`: fused image and text q/k/v), its
MLP names on FLUX.2's ``linear_in`` / ``linear_out``, three shared modulation linears instead of one per block
(``double_stream_modulation_img.lin``, ...), a single block whose ``linear1`` / ``linear2`` are diffusers' own fused
``attn.to_qkv_mlp_proj`` / ``attn.to_out`` (plain renames), and no biases. The plugin names this module as its
``key_tables``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module, count_blocks
from diffpipe_flux.bfl import double_attention, double_mlps, embedders, single_norms
from diffpipe_flux.chroma_keys import inner_dim

TGE = "time_guidance_embed"
MODULATIONS = ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation")


def flux2_layout(num_double: int, num_single: int, guidance: bool, inner: int) -> KeyTable:
    """Every module of a FLUX.2 transformer of these sizes (``inner``: heads x head dim)."""
    modules = embedders(TGE, guidance, vector=False)
    modules += [Module(f"{m}.lin", (f"{m}.linear",)) for m in MODULATIONS]
    for i in range(num_double):
        b, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        modules += [*double_attention(b, d, (inner,) * 3), *double_mlps(b, d, "linear_in", "linear_out")]
    for i in range(num_single):
        b, d = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        modules += [
            Module(f"{b}.linear1", (f"{d}.attn.to_qkv_mlp_proj",)),
            Module(f"{b}.linear2", (f"{d}.attn.to_out",)),
            *single_norms(b, d),
        ]
    modules += [
        Module("final_layer.linear", ("proj_out",)),
        Module("final_layer.adaLN_modulation.1", ("norm_out.linear",), swap=True),
    ]
    return KeyTable(tuple(modules), name="BFL FLUX.2", model="FLUX.2 transformer")


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    """The table of a ``Flux2Transformer2DModel`` config (``transformer/config.json``)."""
    return flux2_layout(
        int(config.get("num_layers", 8)),
        int(config.get("num_single_layers", 48)),
        bool(config.get("guidance_embeds", True)),
        inner_dim(config, 48, 128),
    )


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The table for a ComfyUI export of a peft LoRA of FLUX.2, sized from its module names and shapes (the inner
    dim: the input width of its first adapted block linear)."""
    keys = list(state)
    first = next((v for k, v in state.items() if k.endswith(".lora_A.weight") and "blocks." in k), None)
    return flux2_layout(
        count_blocks(keys, r"transformer_blocks\.(\d+)\."),
        count_blocks(keys, r"single_transformer_blocks\.(\d+)\."),
        False,
        int(first.shape[1]) if first is not None else 0,
    )

