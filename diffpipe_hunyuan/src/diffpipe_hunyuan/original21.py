"""HunyuanImage-2.1's original (Tencent) key layout, and ComfyUI's names for it, as tables of diffusers modules.

Tencent's ``hunyuanimage2.1.safetensors`` / ``hunyuanimage2.1-distilled.safetensors`` (and Comfy-Org's repackaged
``hunyuanimage2.1_bf16.safetensors``) hold HunyuanVideo 1.0's names for the token refiner (``txt_in``), the double
blocks (``img_attn_qkv`` fused), the single blocks (``linear1`` = q, k, v and the MLP input) and the final layer; the
image model adds ``time_in`` (no pooled text ``vector_in``), ``byt5_in`` (the glyph ByT5 projection), ``guidance_in``
(the guidance-distilled checkpoint) and ``time_r_in`` (its MeanFlow second time). This is the mapping of diffusers'
``scripts/convert_hunyuan_image_to_diffusers.py`` with its q, k, v split done by the table.

ComfyUI holds the model as its HunyuanVideo class (``comfy/ldm/hunyuan_video/model.py``, ``HunyuanImage21`` in
``comfy/supported_models.py``), whose ``process_unet_state_dict`` renames Tencent's names (``img_attn.qkv``,
``img_mod.lin``, ``img_mlp.0``, ``time_in.in_layer``, ...): :func:`layouts_for_config` lists both, and a ComfyUI LoRA
(:func:`lora_layout`) uses ComfyUI's names under ``diffusion_model.``, fused as its model fuses, since its
``HunyuanImage21`` model base takes only the generic key map (``diffusion_model.<its module>`` and ``lora_unet_``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module, count_blocks
from diffpipe_hunyuan.original import CE, blocks_and_final, comfyui_layout, lora_width, model_width, tencent_table
from diffpipe_hunyuan.original import token_refiner as refiner

TGE = "time_guidance_embed"
#: the glyph ByT5 projection (``byt5_in``, ComfyUI's ``ByT5Mapper``)
BYT5 = tuple(
    Module(f"byt5_in.{o}", (f"context_embedder_2.{d}",), comfy=None)
    for o, d in (("layernorm", "norm"), ("fc1", "linear_1"), ("fc2", "linear_2"), ("fc3", "linear_3"))
)


def embedder(original: str, model: str) -> list[Module]:
    """A timestep MLP (``<original>.mlp.0`` / ``.2``): diffusers' ``TimestepEmbedding`` ``linear_1`` / ``linear_2``."""
    return [Module(f"{original}.mlp.{i}", (f"{TGE}.{model}.linear_{n}",), comfy=None) for i, n in ((0, 1), (2, 2))]


def layout(
    num_double: int, num_single: int, num_refiner: int, width: int, *, byt5: bool = True, guidance: bool = False,
    meanflow: bool = False, mlp_ratio: float = 4.0,
) -> KeyTable:
    """Every module of a HunyuanImage-2.1 transformer of these sizes in Tencent's layout (``width``: heads x head
    dim; ``guidance`` and ``meanflow``: the distilled checkpoint's embedders)."""
    head = embedder("time_in", "timestep_embedder")
    if meanflow:
        head += embedder("time_r_in", "timestep_embedder_r")
    if guidance:
        head += embedder("guidance_in", "guidance_embedder")
    modules = [Module("img_in.proj", ("x_embedder.proj",), comfy=None), *(BYT5 if byt5 else ())]
    modules += [replace(m, comfy=None) for m in refiner(num_refiner, width, tuple(head))]
    return tencent_table([*modules, *blocks_and_final(num_double, num_single, width, mlp_ratio)], "HunyuanImage-2.1")


def layout_for_config(c: Mapping[str, Any]) -> KeyTable:
    """The table of the transformer ``config`` (``transformer/config.json``) describes."""
    width = int(c["num_attention_heads"]) * int(c["attention_head_dim"])
    return layout(
        int(c["num_layers"]), int(c["num_single_layers"]), int(c.get("num_refiner_layers", 2)), width,
        byt5=c.get("text_embed_2_dim") is not None, guidance=bool(c.get("guidance_embeds")),
        meanflow=bool(c.get("use_meanflow")), mlp_ratio=float(c.get("mlp_ratio", 4.0)),
    )


def layouts_for_config(c: Mapping[str, Any]) -> list[KeyTable]:
    """Both layouts a ``diffusion_model`` file of this config may be in: Tencent's (the released files and Comfy-Org's
    repackaged ones) and ComfyUI's own names (a file ComfyUI saved)."""
    table = layout_for_config(c)
    return [table, comfyui_layout(table)]


def layout_for_model_keys(keys: Iterable[str], width: int) -> KeyTable:
    """The table for a diffusers state dict (or LoRA module names) with these keys."""
    keys = list(keys)
    return layout(
        count_blocks(keys, r"(?:^|\.)transformer_blocks\.(\d+)\."),
        count_blocks(keys, r"single_transformer_blocks\.(\d+)\."),
        count_blocks(keys, rf"{CE}\.token_refiner\.refiner_blocks\.(\d+)\."),
        width,
        byt5=any(k.startswith("context_embedder_2.") for k in keys),
        guidance=any(k.startswith(f"{TGE}.guidance_embedder.") for k in keys),
        meanflow=any(k.startswith(f"{TGE}.timestep_embedder_r.") for k in keys),
    )


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The table for a ComfyUI export of a peft LoRA (its modules' ``comfy`` names are ComfyUI's, fused as its model
    fuses): blocks counted from its modules, the width read from the input of an adapted part of a fused module."""
    return layout_for_model_keys(state, lora_width(state))


def diffusers_to_original(state: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers ``HunyuanImageTransformer2DModel`` state dict in Tencent's layout."""
    return layout_for_model_keys(state, model_width(state)).to_original(state)
