"""Stability's MMDiT key layout of SD3 / SD3.5 (``sd3.5_large.safetensors``, ``sd3_medium.safetensors``, as ComfyUI
loads them) as a table of diffusers modules.

``joint_blocks.N.x_block.attn.qkv`` is ``transformer_blocks.N.attn.to_q``, ``to_k``, ``to_v`` stacked along the
output rows (``context_block.attn.qkv`` the ``add_*_proj``, ``x_block.attn2.qkv`` SD3.5 Medium's second attention);
``x_embedder.proj`` is ``pos_embed.proj`` and the top-level ``pos_embed`` its table; the final adaLN linear, and the
last block's context adaLN (``context_pre_only``), hold their shift and scale halves in the opposite order. The last
block has no context output projection or MLP. This is the mapping of diffusers'
``convert_sd3_transformer_checkpoint_to_diffusers`` (a test checks the two agree); ComfyUI's MMDiT uses these
names, so its LoRA key map takes them under ``diffusion_model.``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module, count_blocks

NORM = (("weight", "weight"),)  # the q/k RMS norms: a weight only


def _attention(b: str, d: str, inner: int, qk_norm: bool) -> list[Module]:
    qkv = (inner,) * 3
    modules = [
        Module(f"{b}.x_block.attn.qkv", (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"), qkv),
        Module(f"{b}.context_block.attn.qkv", (f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"),
               qkv),
        Module(f"{b}.x_block.attn.proj", (f"{d}.attn.to_out.0",)),
    ]
    if qk_norm:
        modules += [
            Module(f"{b}.x_block.attn.ln_q", (f"{d}.attn.norm_q",), params=NORM, comfy=None),
            Module(f"{b}.x_block.attn.ln_k", (f"{d}.attn.norm_k",), params=NORM, comfy=None),
            Module(f"{b}.context_block.attn.ln_q", (f"{d}.attn.norm_added_q",), params=NORM, comfy=None),
            Module(f"{b}.context_block.attn.ln_k", (f"{d}.attn.norm_added_k",), params=NORM, comfy=None),
        ]
    return modules


def _second_attention(b: str, d: str, inner: int, qk_norm: bool) -> list[Module]:
    """SD3.5 Medium's image-only attention of its first blocks (``dual_attention_layers``)."""
    modules = [
        Module(f"{b}.x_block.attn2.qkv", (f"{d}.attn2.to_q", f"{d}.attn2.to_k", f"{d}.attn2.to_v"), (inner,) * 3),
        Module(f"{b}.x_block.attn2.proj", (f"{d}.attn2.to_out.0",)),
    ]
    if qk_norm:
        modules += [
            Module(f"{b}.x_block.attn2.ln_q", (f"{d}.attn2.norm_q",), params=NORM, comfy=None),
            Module(f"{b}.x_block.attn2.ln_k", (f"{d}.attn2.norm_k",), params=NORM, comfy=None),
        ]
    return modules


def layout(num_layers: int, inner: int, dual: Iterable[int] = (), qk_norm: bool = False) -> KeyTable:
    """Every module of an SD3 transformer of ``num_layers`` blocks of width ``inner`` (heads x head dim), with a
    second attention in the ``dual`` blocks and q/k RMS norms with ``qk_norm``."""
    dual = set(dual)
    modules = [
        Module("", ("pos_embed",), params=(("pos_embed", "pos_embed"),), comfy=None),
        Module("x_embedder.proj", ("pos_embed.proj",)),
        Module("t_embedder.mlp.0", ("time_text_embed.timestep_embedder.linear_1",)),
        Module("t_embedder.mlp.2", ("time_text_embed.timestep_embedder.linear_2",)),
        Module("y_embedder.mlp.0", ("time_text_embed.text_embedder.linear_1",)),
        Module("y_embedder.mlp.2", ("time_text_embed.text_embedder.linear_2",)),
        Module("context_embedder", ("context_embedder",)),
    ]
    for i in range(num_layers):
        b, d = f"joint_blocks.{i}", f"transformer_blocks.{i}"
        last = i == num_layers - 1
        modules += _attention(b, d, inner, qk_norm)
        if i in dual:
            modules += _second_attention(b, d, inner, qk_norm)
        modules += [
            Module(f"{b}.x_block.adaLN_modulation.1", (f"{d}.norm1.linear",)),
            Module(f"{b}.context_block.adaLN_modulation.1", (f"{d}.norm1_context.linear",), swap=last),
            Module(f"{b}.x_block.mlp.fc1", (f"{d}.ff.net.0.proj",)),
            Module(f"{b}.x_block.mlp.fc2", (f"{d}.ff.net.2",)),
        ]
        if not last:  # context_pre_only: the last block's text stream ends at its attention's keys and values
            modules += [
                Module(f"{b}.context_block.attn.proj", (f"{d}.attn.to_add_out",)),
                Module(f"{b}.context_block.mlp.fc1", (f"{d}.ff_context.net.0.proj",)),
                Module(f"{b}.context_block.mlp.fc2", (f"{d}.ff_context.net.2",)),
            ]
    modules += [
        Module("final_layer.linear", ("proj_out",)),
        Module("final_layer.adaLN_modulation.1", ("norm_out.linear",), swap=True),
    ]
    return KeyTable(tuple(modules), name="Stability MMDiT", model="SD3 transformer")


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    """The table of the transformer ``config`` (``transformer/config.json``) describes."""
    inner = int(config.get("num_attention_heads", 18)) * int(config.get("attention_head_dim", 64))
    dual = config.get("dual_attention_layers") or ()
    return layout(int(config.get("num_layers", 18)), inner, dual, bool(config.get("qk_norm")))


#: block linears whose input is the transformer's width (so a LoRA on any of them tells it)
WIDTH_INPUTS = (
    *("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    *("attn.to_add_out", "attn2.to_q", "attn2.to_k", "attn2.to_v", "norm1.linear", "ff.net.0.proj"),
    "ff_context.net.0.proj",
)


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The table for a ComfyUI export of a peft LoRA (``state``: its tensors): blocks counted from its module names,
    the width read from the input of an adapted attention linear."""
    keys = list(state)
    num_layers = count_blocks(keys, r"(?:.*\.)?transformer_blocks\.(\d+)\.")
    dual = {int(m.group(1)) for k in keys if (m := re.match(r"transformer_blocks\.(\d+)\.attn2\.", k))}
    inner = next((int(v.shape[1]) for k, v in state.items() if k.endswith(tuple(f"{w}.lora_A.weight" for w in
                                                                                  WIDTH_INPUTS))), 0)
    return layout(num_layers, inner, dual)


def diffusers_to_original(state: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers ``SD3Transformer2DModel`` state dict (of the transformer ``config``) in Stability's layout."""
    return layout_for_config(config).to_original(state)
