"""The original Z-Image key layout (Tongyi-MAI's checkpoint, as ComfyUI ships ``z_image*.safetensors``) as a table of
diffusers modules.

It differs from diffusers' ``ZImageTransformer2DModel`` in a few names only: every block's ``attention.qkv`` is
``attention.to_q``, ``to_k``, ``to_v`` stacked along the output rows, ``attention.out`` is ``attention.to_out.0``, the
q/k RMS norms are ``q_norm``/``k_norm``, and the patch embedder and final layer drop diffusers' ``all_..2-1``
wrappers. Everything else keeps its name (``passthrough``). This is the mapping of diffusers' own converter
(``convert_z_image_transformer_checkpoint_to_diffusers``) and of ComfyUI's ``z_image_to_diffusers``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module, count_blocks

BLOCK_GROUPS = ("noise_refiner", "context_refiner", "layers")


def layout(blocks: Mapping[str, int], patch: str = "2-1") -> KeyTable:
    """The table of a Z-Image transformer with ``blocks[group]`` blocks per group (``noise_refiner``,
    ``context_refiner``, ``layers``); ``patch``: the ``all_x_embedder`` / ``all_final_layer`` key (``"2-1"``)."""
    modules = [
        Module("x_embedder", (f"all_x_embedder.{patch}",)),
        Module("final_layer.linear", (f"all_final_layer.{patch}.linear",)),
        Module("final_layer.adaLN_modulation.1", (f"all_final_layer.{patch}.adaLN_modulation.1",)),
    ]
    for group in BLOCK_GROUPS:
        for i in range(blocks.get(group, 0)):
            a = f"{group}.{i}.attention"
            modules += [
                Module(f"{a}.qkv", (f"{a}.to_q", f"{a}.to_k", f"{a}.to_v"), params=(("weight", "weight"),)),
                Module(f"{a}.out", (f"{a}.to_out.0",), params=(("weight", "weight"),)),
                Module(f"{a}.q_norm", (f"{a}.norm_q",), params=(("weight", "weight"),), comfy=None),
                Module(f"{a}.k_norm", (f"{a}.norm_k",), params=(("weight", "weight"),), comfy=None),
            ]
    # norm_final.weight: an unused leftover some original files hold; diffusers' converter drops it too
    return KeyTable(tuple(modules), name="original Z-Image", model="Z-Image transformer", passthrough=True,
                    skip=r"^norm_final\.")


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    """The table of the transformer ``config`` (``transformer/config.json``) describes."""
    refiners = int(config.get("n_refiner_layers", 2))
    return layout({"noise_refiner": refiners, "context_refiner": refiners, "layers": int(config.get("n_layers", 30))})


def layout_for_keys(keys: Iterable[str]) -> KeyTable:
    """The table for state-dict keys or LoRA module names of either layout (blocks counted from them)."""
    keys = list(keys)
    return layout({g: count_blocks(keys, rf"(?:.*\.)?{g}\.(\d+)\.") for g in BLOCK_GROUPS})


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The table for a ComfyUI export of a peft LoRA (blocks counted from its module names)."""
    return layout_for_keys(state)


def diffusers_to_original(state: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers ``ZImageTransformer2DModel`` state dict in the original key layout."""
    return layout_for_keys(state).to_original(state)


def original_to_diffusers(state: Mapping[str, Any], source: str = "Z-Image checkpoint") -> dict[str, Any]:
    """An original-layout Z-Image state dict (keys optionally under ``model.diffusion_model.``) in diffusers' keys."""
    table = layout({})
    return layout_for_keys(table.strip(k) for k in state).to_model(state, source)
