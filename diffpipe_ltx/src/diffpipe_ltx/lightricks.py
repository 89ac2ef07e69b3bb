"""The original Lightricks (LTX-Video repository, ComfyUI) key layout of the transformer, as a key table.

It differs from diffusers' ``LTXVideoTransformer3DModel`` only by renames, with no fused tensors (the inverse of
diffusers' ``convert_ltx_transformer_checkpoint_to_diffusers``): ``proj_in`` = ``patchify_proj`` and ``time_embed`` =
``adaln_single`` (whole subtrees), and each block's ``attnN.norm_q`` / ``norm_k`` = ``attnN.q_norm`` / ``k_norm``.
Downloaded checkpoints hold the transformer under ``model.diffusion_model.`` (beside ``vae.*`` and other parts).
Loading, per-stage loading, the ``single_file`` export and the ComfyUI LoRA export read this one table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module

FILE_PREFIX = "model.diffusion_model."


def layout(num_layers: int) -> KeyTable:
    """The table of a transformer with ``num_layers`` blocks (only the in-block norm renames depend on it)."""
    norms = [
        Module(f"transformer_blocks.{i}.attn{a}.{orig}", (f"transformer_blocks.{i}.attn{a}.{ours}",), params=None)
        for i in range(num_layers)
        for a in (1, 2)
        for orig, ours in (("q_norm", "norm_q"), ("k_norm", "norm_k"))
    ]
    return KeyTable(
        tuple(norms),
        name="original Lightricks",
        model="LTX-Video transformer",
        read_prefixes=(FILE_PREFIX,),
        write_prefix=FILE_PREFIX,
        renames=(("patchify_proj", "proj_in"), ("adaln_single", "time_embed")),
        passthrough=True,
    )


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    return layout(int(config.get("num_layers", 28)))


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The layout for a ComfyUI LoRA: its modules differ only by the top-level renames."""
    return layout(0)


def keys_in_original(table_of: Callable[[int], KeyTable], state: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers transformer state dict in original key names (without the file prefix), by the table
    ``table_of(number of transformer blocks)``: LTX-Video's :func:`layout` or LTX-2's."""
    blocks = {int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks.")}
    out = table_of(max(blocks, default=-1) + 1).to_original(state)
    return {k[len(FILE_PREFIX) :]: v for k, v in out.items()}


def to_original(state: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers LTX-Video transformer state dict in original key names (without the file prefix)."""
    return keys_in_original(layout, state)


def original_name(name: str) -> str:
    """A diffusers parameter name -> its original Lightricks name (no file prefix)."""
    return layout(int(name.split(".")[1]) + 1 if name.startswith("transformer_blocks.") else 0).original_key(name)


def diffusers_name(name: str) -> str:
    """An original Lightricks name (without ``model.diffusion_model.``) -> the diffusers name."""
    index = int(name.split(".")[1]) + 1 if name.startswith("transformer_blocks.") else 0
    (target, _), *_ = layout(index).targets(name)
    return target
