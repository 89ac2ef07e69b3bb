"""Lumina Image 2.0's original key layout (Alpha-VLLM's NextDiT, as ComfyUI loads ``lumina_2_model_bf16.safetensors``
and the ``model.diffusion_model.`` part of the all-in-one ``lumina_2.safetensors``) as a table of diffusers modules.

Every block (``noise_refiner.N``, ``context_refiner.N``, ``layers.N``) fuses ``attention.qkv`` = ``attn.to_q | to_k |
to_v`` stacked along the output rows (the key and value parts are ``num_kv_heads`` heads wide, the query part
``num_attention_heads``); ``attention.out`` is ``attn.to_out.0``, ``attention.q_norm``/``k_norm`` are ``attn.norm_q``/
``norm_k``, ``feed_forward.w1/w2/w3`` are ``feed_forward.linear_1/2/3``, ``attention_norm1`` is ``norm1.norm``
(``norm1`` in the unmodulated context refiner), ``attention_norm2`` is ``norm2``, ``adaLN_modulation.1`` is
``norm1.linear``. ``t_embedder.mlp.0/2`` and ``cap_embedder.0/1`` are ``time_caption_embed``'s timestep MLP and
caption norm and projection, ``final_layer.adaLN_modulation.1`` / ``final_layer.linear`` are ``norm_out.linear_1`` /
``linear_2``; ``x_embedder`` and the ``ffn_norm``s keep their names. ``norm_final.weight``, which the original
checkpoints hold and nothing uses, is dropped on reading. This is the mapping of diffusers'
``convert_lumina2_to_diffusers`` (which splits ``qkv`` at the 2B release's sizes only; this table reads the sizes from
the config), and ComfyUI's LoRA key map accepts every weight of it as ``diffusion_model.<name>``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module, count_blocks

BLOCK_GROUPS = ("noise_refiner", "context_refiner", "layers")
FEED_FORWARD = {"w1": "linear_1", "w2": "linear_2", "w3": "linear_3"}
WEIGHT = (("weight", "weight"),)


def layout(blocks: Mapping[str, int], q_rows: int = 0, kv_rows: int = 0) -> KeyTable:
    """The table of a Lumina 2 transformer with ``blocks[group]`` blocks per group; ``q_rows`` / ``kv_rows``: the
    query and key/value widths of the fused ``qkv`` (0: equal thirds, for module names alone)."""
    sizes = (q_rows, kv_rows, kv_rows) if q_rows else ()
    modules = [
        Module("t_embedder.mlp.0", ("time_caption_embed.timestep_embedder.linear_1",)),
        Module("t_embedder.mlp.2", ("time_caption_embed.timestep_embedder.linear_2",)),
        Module("cap_embedder.0", ("time_caption_embed.caption_embedder.0",), params=WEIGHT, comfy=None),
        Module("cap_embedder.1", ("time_caption_embed.caption_embedder.1",)),
        Module("final_layer.adaLN_modulation.1", ("norm_out.linear_1",)),
        Module("final_layer.linear", ("norm_out.linear_2",)),
    ]
    for group in BLOCK_GROUPS:
        for i in range(blocks.get(group, 0)):
            b = f"{group}.{i}"
            parts = tuple(f"{b}.attn.{p}" for p in ("to_q", "to_k", "to_v"))
            modules += [
                Module(f"{b}.attention.qkv", parts, sizes=sizes, params=WEIGHT),
                Module(f"{b}.attention.out", (f"{b}.attn.to_out.0",), params=WEIGHT),
                Module(f"{b}.attention.q_norm", (f"{b}.attn.norm_q",), params=WEIGHT, comfy=None),
                Module(f"{b}.attention.k_norm", (f"{b}.attn.norm_k",), params=WEIGHT, comfy=None),
                *(Module(f"{b}.feed_forward.{o}", (f"{b}.feed_forward.{m}",), params=WEIGHT)
                  for o, m in FEED_FORWARD.items()),
                Module(f"{b}.attention_norm2", (f"{b}.norm2",), params=WEIGHT, comfy=None),
            ]
            if group == "context_refiner":  # no modulation: a plain RMS norm
                modules.append(Module(f"{b}.attention_norm1", (f"{b}.norm1",), params=WEIGHT, comfy=None))
            else:
                modules += [
                    Module(f"{b}.attention_norm1", (f"{b}.norm1.norm",), params=WEIGHT, comfy=None),
                    Module(f"{b}.adaLN_modulation.1", (f"{b}.norm1.linear",)),
                ]
    # x_embedder and the ffn_norm1/ffn_norm2 RMS norms keep their names
    return KeyTable(tuple(modules), name="original Lumina 2", model="Lumina 2 transformer", passthrough=True,
                    skip=r"^norm_final\.")


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    """The table of the transformer ``config`` (``transformer/config.json``) describes."""
    refiners = int(config.get("num_refiner_layers", 2))
    dim, heads = int(config.get("hidden_size", 2304)), int(config.get("num_attention_heads", 24))
    kv_heads = int(config.get("num_kv_heads") or heads)
    blocks = {"noise_refiner": refiners, "context_refiner": refiners, "layers": int(config.get("num_layers", 26))}
    return layout(blocks, dim, kv_heads * (dim // heads))


def layout_for_keys(keys: Iterable[str]) -> KeyTable:
    """The table for state-dict keys or LoRA module names of either layout (blocks counted from them)."""
    keys = list(keys)
    return layout({g: count_blocks(keys, rf"(?:.*\.)?{g}\.(\d+)\.") for g in BLOCK_GROUPS})


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The table for a ComfyUI export of a peft LoRA (blocks counted from its module names)."""
    return layout_for_keys(state)


def diffusers_to_original(state: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers ``Lumina2Transformer2DModel`` state dict (of the transformer ``config``) in the original layout."""
    return layout_for_config(config).to_original(state)
