"""The original Wan key layout of the transformer (the Wan repositories' ``WanModel``, as ComfyUI and the Wan
checkpoints ship it), as a key table.

It differs from diffusers' ``WanTransformer3DModel`` by renames only (the inverse of diffusers'
``convert_wan_transformer_to_diffusers``), with no fused tensors:

- in each block ``blocks.N.``: ``self_attn.{q,k,v,o}`` = ``attn1.{to_q,to_k,to_v,to_out.0}``, ``cross_attn.*`` =
  ``attn2.*`` (with the image-to-video ``k_img`` / ``v_img`` / ``norm_k_img`` = ``add_k_proj`` / ``add_v_proj`` /
  ``norm_added_k``), ``ffn.0`` / ``ffn.2`` = ``ffn.net.0.proj`` / ``ffn.net.2``, the affine cross-attention norm
  ``norm3`` = ``norm2`` (the unnamed, parameter-free norms swap numbers too), ``modulation`` = ``scale_shift_table``;
- at the top: ``text_embedding.0/2``, ``time_embedding.0/2``, ``time_projection.1`` = ``condition_embedder``'s
  ``text_embedder.linear_1/2``, ``time_embedder.linear_1/2``, ``time_proj``; ``img_emb.proj.0/1/3/4`` (and the
  first-last-frame ``img_emb.emb_pos``) = its ``image_embedder``; ``head.head`` / ``head.modulation`` = ``proj_out`` /
  ``scale_shift_table``; ``patch_embedding`` keeps its name.

Files hold the transformer bare (ComfyUI's ``diffusion_models`` files) or under ``model.diffusion_model.``. ComfyUI's
Wan model uses exactly these names, so its LoRA keys are ``diffusion_model.<original module>`` (plugin README).
Loading, per-stage loading, the ``single_file`` export and the ComfyUI LoRA export read this one table.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module

#: (original, diffusers) module names inside a block whose parameters keep their names
BLOCK_MODULES = (
    ("self_attn.q", "attn1.to_q"),
    ("self_attn.k", "attn1.to_k"),
    ("self_attn.v", "attn1.to_v"),
    ("self_attn.o", "attn1.to_out.0"),
    ("cross_attn.q", "attn2.to_q"),
    ("cross_attn.k", "attn2.to_k"),
    ("cross_attn.v", "attn2.to_v"),
    ("cross_attn.o", "attn2.to_out.0"),
    ("cross_attn.k_img", "attn2.add_k_proj"),
    ("cross_attn.v_img", "attn2.add_v_proj"),
    ("cross_attn.norm_k_img", "attn2.norm_added_k"),
    ("ffn.0", "ffn.net.0.proj"),
    ("ffn.2", "ffn.net.2"),
    ("norm3", "norm2"),
)
#: (original, diffusers) prefixes of whole subtrees outside the blocks
TOP_RENAMES = (
    ("patch_embedding", "patch_embedding"),
    ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    ("time_projection.1", "condition_embedder.time_proj"),
    ("img_emb.proj.0", "condition_embedder.image_embedder.norm1"),
    ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
    ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
    ("img_emb.proj.4", "condition_embedder.image_embedder.norm2"),
    ("img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"),
    ("head.head", "proj_out"),
    ("head.modulation", "scale_shift_table"),
)
FILE_PREFIX = "model.diffusion_model."


def layout(num_layers: int) -> KeyTable:
    """The table of a transformer with ``num_layers`` blocks (text-to-video and image-to-video alike: entries of
    modules a model lacks are never looked up)."""
    modules = tuple(
        Module(f"blocks.{i}.{orig}", (f"blocks.{i}.{ours}",), params=None)
        for i in range(num_layers)
        for orig, ours in BLOCK_MODULES
    )
    per_block = tuple(
        pair
        for i in range(num_layers)
        for pair in (
            (f"blocks.{i}.self_attn", f"blocks.{i}.attn1"),  # norm_q, norm_k
            (f"blocks.{i}.cross_attn", f"blocks.{i}.attn2"),
            (f"blocks.{i}.modulation", f"blocks.{i}.scale_shift_table"),
        )
    )
    return KeyTable(
        modules,
        name="original Wan",
        model="Wan transformer",
        read_prefixes=(FILE_PREFIX, "diffusion_model."),
        renames=TOP_RENAMES + per_block,
    )


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    """The table sized from a diffusers ``config.json`` of ``WanTransformer3DModel``."""
    return layout(int(config.get("num_layers", 40)))


def lora_layout(state_dict: Mapping[str, Any]) -> KeyTable:
    """The table for a ComfyUI export of a peft LoRA ``state_dict`` (sized by the blocks its keys name)."""
    return layout(blocks_in(state_dict))


def blocks_in(keys: Iterable[str]) -> int:
    """``max(N) + 1`` over the ``blocks.N.`` module paths (diffusers or original names) in ``keys``."""
    found = {int(m.group(1)) for k in keys if (m := re.match(r"(?:.*\.)?blocks\.(\d+)\.", k))}
    return max(found) + 1 if found else 0
