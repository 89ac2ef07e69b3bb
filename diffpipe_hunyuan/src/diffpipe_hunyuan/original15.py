"""HunyuanVideo-1.5's original (Tencent) key layout, and the fused one ComfyUI's model holds, as tables of diffusers
modules.

Tencent's files (``transformer/480p_t2v/diffusion_pytorch_model.safetensors``, ...) name the token refiner, the
double blocks and the final layer as HunyuanVideo 1.0's do, except that each double block's q, k, v are three
tensors (``double_blocks.N.img_attn_q``, ``img_attn_k``, ``img_attn_v``, and ``txt_attn_*``); the new parts are
``time_in`` (no pooled text or guidance embedding), ``byt5_in`` (the glyph ByT5 projection), ``vision_in`` (the
SigLIP image projection) and ``cond_type_embedding``. Loading, per-stage loading and the ``single_file`` export read
:func:`layout_for_config`; a ``diffusion_model`` file may be in either layout (:func:`layouts_for_config`).

ComfyUI's HunyuanVideo model (``comfy/ldm/hunyuan_video/model.py``, on Flux's ``DoubleStreamBlock``) holds each
double block's q, k, v as one ``img_attn.qkv`` / ``txt_attn.qkv`` weight, so the ComfyUI LoRA export
(:func:`lora_layout`) is written on the fused table: ``diffusion_model.double_blocks.N.img_attn.qkv`` = to_q | to_k |
to_v, ``img_attn.proj``, ``img_mod.lin``, ``img_mlp.0`` / ``.2`` and the ``txt_`` twins, as for HunyuanVideo 1.0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module, count_blocks
from diffpipe_hunyuan.original import CE, FINAL_LAYER, double_block, lora_width, model_width, token_refiner

#: modules of 1.5 only, outside the token refiner and the blocks (ComfyUI's LoRA map is not claimed for them)
HEAD = (
    Module("time_in.mlp.0", ("time_embed.timestep_embedder.linear_1",), comfy=None),
    Module("time_in.mlp.2", ("time_embed.timestep_embedder.linear_2",), comfy=None),
    Module("byt5_in.layernorm", ("context_embedder_2.norm",), comfy=None),
    Module("byt5_in.fc1", ("context_embedder_2.linear_1",), comfy=None),
    Module("byt5_in.fc2", ("context_embedder_2.linear_2",), comfy=None),
    Module("byt5_in.fc3", ("context_embedder_2.linear_3",), comfy=None),
    Module("vision_in.proj.0", ("image_embedder.norm_in",), comfy=None),
    Module("vision_in.proj.1", ("image_embedder.linear_1",), comfy=None),
    Module("vision_in.proj.3", ("image_embedder.linear_2",), comfy=None),
    Module("vision_in.proj.4", ("image_embedder.norm_out",), comfy=None),
    Module("cond_type_embedding", ("cond_type_embed",), comfy=None),
)


def layout(num_double: int, num_refiner: int, width: int, fused: bool = False) -> KeyTable:
    """Every module of a HunyuanVideo-1.5 transformer of these sizes (``width``: heads x head dim) in Tencent's
    layout (q, k, v split), or with ``fused`` in the layout ComfyUI holds (q, k, v stacked)."""
    modules = [
        Module("img_in.proj", ("x_embedder.proj",), comfy=None),
        *(replace(m, comfy=None) for m in token_refiner(num_refiner, width, HEAD)),
    ]
    for i in range(num_double):
        modules += double_block(i, width, split_qkv=not fused)
    modules += FINAL_LAYER
    return KeyTable(
        tuple(modules),
        name="ComfyUI (fused q, k, v)" if fused else "original Tencent",
        model="HunyuanVideo-1.5 transformer",
        read_prefixes=("model.diffusion_model.", "diffusion_model.", "module."),
    )


def layout_for_config(c: Mapping[str, Any]) -> KeyTable:
    """The table of the transformer ``config`` (``transformer/config.json``) describes; a MeanFlow (super-resolution)
    transformer is refused."""
    if c.get("use_meanflow"):
        raise ValueError(
            "use_meanflow is set in the transformer config: a HunyuanVideo-1.5 super-resolution (MeanFlow) "
            "transformer, which diffpipe-hunyuan does not train; give a 480p/720p t2v or i2v transformer"
        )
    width = int(c["num_attention_heads"]) * int(c["attention_head_dim"])
    return layout(int(c["num_layers"]), int(c["num_refiner_layers"]), width)


def layouts_for_config(c: Mapping[str, Any]) -> list[KeyTable]:
    """Both layouts a ``diffusion_model`` file of this config may be in: Tencent's (q, k, v split) and that of
    ComfyUI's repackaged files (``hunyuanvideo1.5_720p_t2v_fp16.safetensors``: q, k, v fused, as ComfyUI's model
    holds them)."""
    table = layout_for_config(c)
    width = int(c["num_attention_heads"]) * int(c["attention_head_dim"])
    return [table, layout(int(c["num_layers"]), int(c["num_refiner_layers"]), width, fused=True)]


def layout_for_model_keys(keys: Iterable[str], width: int, fused: bool = False) -> KeyTable:
    """The table for a diffusers state dict (or LoRA module names) with these keys."""
    keys = list(keys)
    return layout(
        count_blocks(keys, r"transformer_blocks\.(\d+)\."),
        count_blocks(keys, rf"{CE}\.token_refiner\.refiner_blocks\.(\d+)\."),
        width,
        fused,
    )


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The fused (ComfyUI) table for a ComfyUI export of a peft LoRA: blocks counted from its modules, the width read
    from the input of an adapted q, k or v."""
    return layout_for_model_keys(state, lora_width(state), fused=True)


def diffusers_to_original(state: Mapping[str, Any], fused: bool = False) -> dict[str, Any]:
    """A diffusers ``HunyuanVideo15Transformer3DModel`` state dict in Tencent's layout (``fused``: ComfyUI's)."""
    return layout_for_model_keys(state, model_width(state), fused).to_original(state)


def original_to_diffusers(state: Mapping[str, Any], source: str = "checkpoint") -> dict[str, Any]:
    """An original-layout state dict (Tencent's split q, k, v, or fused as ComfyUI holds it; keys optionally under
    ``model.diffusion_model.``) in diffusers' key layout, sized from its tensors."""
    bare = layout(0, 0, 0)
    keys = [bare.strip(k) for k in state]
    width = next((int(v.shape[0]) for k, v in state.items() if bare.strip(k).endswith("img_attn_proj.weight")), 0)
    table = layout(
        count_blocks(keys, r"double_blocks\.(\d+)\."),
        count_blocks(keys, r"txt_in\.individual_token_refiner\.blocks\.(\d+)\."),
        width,
        fused=any(k.endswith("img_attn_qkv.weight") for k in keys),
    )
    return table.to_model(state, source)
