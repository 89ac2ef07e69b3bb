"""The original (Black Forest Labs) Flux key layout as a table of diffusers modules.

``double_blocks.N.img_attn.qkv`` is ``transformer_blocks.N.attn.to_q``, ``to_k``, ``to_v`` stacked along the output
rows; a single block's ``linear1`` is q, k, v and the MLP input; BFL calls the RMS norms' weights ``scale``; and the
final adaLN linear holds its shift and scale halves in the opposite order. Loading, per-stage loading, the
``single_file`` export and the ComfyUI LoRA export all read this one table (:mod:`diffpipe_core.parts.layout`).

diffusers' own converter assumes the full-size inner dim (3072) when it splits ``linear1``; here the sizes come from
the config (or the tensors), so tiny test models and full-size checkpoints convert alike.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from diffpipe_core.parts.layout import SCALE_NORM, KeyTable, Module, count_blocks

TTE = "time_text_embed"
MLP_RATIO = 4  # FluxSingleTransformerBlock's mlp_ratio


def double_attention(b: str, d: str, qkv: tuple[int, ...] = ()) -> list[Module]:
    """A double block's joint attention (Flux.1 and Chroma alike): the fused image and text q/k/v, the two
    output projections and the four q/k RMS norms (``b``: the block in the original layout, ``d``: in diffusers')."""
    return [
        Module(f"{b}.img_attn.qkv", (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"), qkv),
        Module(f"{b}.txt_attn.qkv", (f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"), qkv),
        Module(f"{b}.img_attn.proj", (f"{d}.attn.to_out.0",)),
        Module(f"{b}.txt_attn.proj", (f"{d}.attn.to_add_out",)),
        Module(f"{b}.img_attn.norm.query_norm", (f"{d}.attn.norm_q",), params=SCALE_NORM, comfy=None),
        Module(f"{b}.img_attn.norm.key_norm", (f"{d}.attn.norm_k",), params=SCALE_NORM, comfy=None),
        Module(f"{b}.txt_attn.norm.query_norm", (f"{d}.attn.norm_added_q",), params=SCALE_NORM, comfy=None),
        Module(f"{b}.txt_attn.norm.key_norm", (f"{d}.attn.norm_added_k",), params=SCALE_NORM, comfy=None),
    ]


def double_mlps(b: str, d: str, linear_in: str = "net.0.proj", linear_out: str = "net.2") -> list[Module]:
    """A double block's image and text MLPs (``img_mlp.0``/``.2`` = ``ff.<linear_in>``/``ff.<linear_out>``)."""
    return [
        Module(f"{b}.img_mlp.0", (f"{d}.ff.{linear_in}",)),
        Module(f"{b}.img_mlp.2", (f"{d}.ff.{linear_out}",)),
        Module(f"{b}.txt_mlp.0", (f"{d}.ff_context.{linear_in}",)),
        Module(f"{b}.txt_mlp.2", (f"{d}.ff_context.{linear_out}",)),
    ]


def single_linears(b: str, d: str, inner: int) -> list[Module]:
    """A Flux.1 (or Chroma) single block's ``linear1`` (q, k, v and the MLP input fused) and ``linear2``."""
    linear1 = (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v", f"{d}.proj_mlp")
    return [
        Module(f"{b}.linear1", linear1, (inner, inner, inner, MLP_RATIO * inner)),
        Module(f"{b}.linear2", (f"{d}.proj_out",)),
    ]


def single_norms(b: str, d: str) -> list[Module]:
    """A single block's q/k RMS norms."""
    return [
        Module(f"{b}.norm.query_norm", (f"{d}.attn.norm_q",), params=SCALE_NORM, comfy=None),
        Module(f"{b}.norm.key_norm", (f"{d}.attn.norm_k",), params=SCALE_NORM, comfy=None),
    ]


def embedders(time_embed: str, guidance: bool, vector: bool = True) -> list[Module]:
    """Image and text input projections, the timestep MLP (diffusers' ``<time_embed>.timestep_embedder``), the pooled
    text vector's (``vector_in``, Flux.1) and the guidance MLP (guidance-distilled models)."""
    modules = [
        Module("img_in", ("x_embedder",)),
        Module("txt_in", ("context_embedder",)),
        Module("time_in.in_layer", (f"{time_embed}.timestep_embedder.linear_1",)),
        Module("time_in.out_layer", (f"{time_embed}.timestep_embedder.linear_2",)),
    ]
    if vector:
        modules += [
            Module("vector_in.in_layer", (f"{time_embed}.text_embedder.linear_1",)),
            Module("vector_in.out_layer", (f"{time_embed}.text_embedder.linear_2",)),
        ]
    if guidance:
        modules += [
            Module("guidance_in.in_layer", (f"{time_embed}.guidance_embedder.linear_1",)),
            Module("guidance_in.out_layer", (f"{time_embed}.guidance_embedder.linear_2",)),
        ]
    return modules


def layout(num_double: int, num_single: int, guidance: bool, inner: int) -> KeyTable:
    """Every module of a Flux transformer of these sizes (``inner``: heads x head dim)."""
    qkv = (inner,) * 3
    modules = embedders(TTE, guidance)
    for i in range(num_double):
        b, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        modules += [
            Module(f"{b}.img_mod.lin", (f"{d}.norm1.linear",)),
            Module(f"{b}.txt_mod.lin", (f"{d}.norm1_context.linear",)),
            *double_attention(b, d, qkv),
            *double_mlps(b, d),
        ]
    for i in range(num_single):
        b, d = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        modulation = Module(f"{b}.modulation.lin", (f"{d}.norm.linear",))
        modules += [modulation, *single_linears(b, d, inner), *single_norms(b, d)]
    modules += [
        Module("final_layer.linear", ("proj_out",)),
        Module("final_layer.adaLN_modulation.1", ("norm_out.linear",), swap=True),
    ]
    return KeyTable(tuple(modules), name="BFL", model="Flux transformer")


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    """The table of the transformer ``config`` (``transformer/config.json``) describes."""
    return layout(
        int(config.get("num_layers", 19)),
        int(config.get("num_single_layers", 38)),
        bool(config.get("guidance_embeds", False)),
        int(config.get("num_attention_heads", 24)) * int(config.get("attention_head_dim", 128)),
    )


def layout_for_model_keys(keys: Iterable[str], inner: int) -> KeyTable:
    """The table for a diffusers state dict (or LoRA module names) with these keys."""
    keys = list(keys)
    return layout(
        count_blocks(keys, r"transformer_blocks\.(\d+)\."),
        count_blocks(keys, r"single_transformer_blocks\.(\d+)\."),
        any(k.startswith(f"{TTE}.guidance_embedder.") for k in keys),
        inner,
    )


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The table for a ComfyUI export of a peft LoRA: blocks counted from its modules, the inner dim read from the
    input width of its first adapted block linear (every fused part reads the block's inner dim)."""
    first = next((v for k, v in state.items() if k.endswith(".lora_A.weight") and "blocks." in k), None)
    return layout_for_model_keys(state, int(first.shape[1]) if first is not None else 0)


def diffusers_to_bfl(state: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers ``FluxTransformer2DModel`` state dict in the original BFL key layout."""
    inner = int(next(v for k, v in state.items() if k.endswith("attn.to_q.weight")).shape[0])
    return layout_for_model_keys(state, inner).to_original(state)


def bfl_to_diffusers(state: Mapping[str, Any], source: str = "BFL checkpoint") -> dict[str, Any]:
    """An original-layout Flux transformer state dict (keys optionally under ``model.diffusion_model.``) in diffusers'
    key layout, sized from its tensors. Unknown keys raise a KeyError naming ``source`` and the key."""
    table = layout(0, 0, False, 0)
    keys = [table.strip(k) for k in state]
    inner = next((int(v.shape[0]) for k, v in state.items() if re.search(r"img_attn\.proj\.weight$", k)), 0)
    return layout(
        count_blocks(keys, r"double_blocks\.(\d+)\."),
        count_blocks(keys, r"single_blocks\.(\d+)\."),
        any(k.startswith("guidance_in.") for k in keys),
        inner,
    ).to_model(state, source)
