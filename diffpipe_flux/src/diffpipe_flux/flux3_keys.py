"""FLUX.3's original key layout (Black Forest Labs' checkpoints, ``flux-3-image-klein*.safetensors``, as diffusers'
``convert_flux3_transformer_checkpoint_to_diffusers`` reads them) as a table of diffusers modules.

Every module is a rename: ``emb_in.<mode>`` / ``txt_in`` are the input projections (``x_embedders.<mode>`` /
``context_embedder``), ``time_in`` (``ref_time_in`` of a flow map) the timestep MLPs, the per-mode modulations
``early_stream_modulations.<mode>.lin`` / ``single_stream_modulations.<mode>.lin`` (``.linear``),
``content_mode_blocks.<mode>.N`` / ``txt_mode_blocks.N`` the per-mode blocks and ``single_blocks.N`` the joint
blocks, whose ``q_proj``, ``k_proj``, ``v_proj``, ``attn_out``, ``mlp_in``, ``mlp_out`` and ``norm.query_norm`` /
``norm.key_norm`` (``scale``) are diffusers' ``attn.to_q`` ... ``ff.linear_out`` and ``attn.norm_q`` / ``attn.norm_k``;
the final adaLN's halves are swapped (BFL's shift, scale).
The training-only ``repa_projectors.*`` are dropped on read. A test checks the table against diffusers' conversion.
ComfyUI has no FLUX.3 model yet; a LoRA's ComfyUI-layout export uses these names under ``diffusion_model.``, which
diffusers' ``Flux3LoraLoaderMixin`` reads as FLUX.3's non-diffusers format.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe_core.parts.layout import SCALE_NORM, KeyTable, Module, count_blocks

MODES = ("image", "image_cond")
#: a block's linears: BFL's name -> diffusers'
BLOCK_LINEARS = {"q_proj": "attn.to_q", "k_proj": "attn.to_k", "v_proj": "attn.to_v", "attn_out": "attn.to_out.0",
                 "mlp_in": "ff.linear_in", "mlp_out": "ff.linear_out"}


def block(original: str, model: str) -> list[Module]:
    """The modules of one block (per-mode and joint blocks alike)."""
    modules = [Module(f"{original}.{o}", (f"{model}.{m}",)) for o, m in BLOCK_LINEARS.items()]
    modules += [
        Module(f"{original}.norm.query_norm", (f"{model}.attn.norm_q",), params=SCALE_NORM, comfy=None),
        Module(f"{original}.norm.key_norm", (f"{model}.attn.norm_k",), params=SCALE_NORM, comfy=None),
    ]
    return modules


def flux3_layout(num_layers: int, num_single: int, flow_map: bool) -> KeyTable:
    """Every module of a FLUX.3 transformer of ``num_layers`` per-mode and ``num_single`` joint blocks (``flow_map``:
    the step-distilled checkpoint's target-time embedder)."""
    modules = [Module("txt_in", ("context_embedder",))]
    modules += [Module(f"emb_in.{m}", (f"x_embedders.{m}",)) for m in MODES]
    embedders = [("time_in", "timestep_embedder")] + ([("ref_time_in", "target_timestep_embedder")] if flow_map else [])
    for original, model in embedders:
        modules += [Module(f"{original}.in_layer", (f"{model}.linear_1",)),
                    Module(f"{original}.out_layer", (f"{model}.linear_2",))]
    for kind in ("early_stream_modulations", "single_stream_modulations"):
        modules += [Module(f"{kind}.{m}.lin", (f"{kind}.{m}.linear",)) for m in (*MODES, "txt")]
    for i in range(num_layers):
        for m in MODES:
            modules += block(f"content_mode_blocks.{m}.{i}", f"mode_blocks.{m}.{i}")
        modules += block(f"txt_mode_blocks.{i}", f"txt_mode_blocks.{i}")
    for i in range(num_single):
        modules += block(f"single_blocks.{i}", f"single_transformer_blocks.{i}")
    modules += [
        Module("final_layer.image.linear", ("proj_out",)),
        Module("final_layer.image.adaLN_modulation.1", ("norm_out.linear",), swap=True),
    ]
    return KeyTable(tuple(modules), name="BFL FLUX.3", model="FLUX.3 transformer", skip=r"^repa_projectors\.")


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    """The table of a ``Flux3Transformer2DModel`` config (``transformer/config.json``)."""
    return flux3_layout(int(config.get("num_layers", 5)), int(config.get("num_single_layers", 28)),
                        bool(config.get("flow_map", False)))


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The table for a ComfyUI-layout export of a peft LoRA of FLUX.3 (blocks counted from its module names)."""
    keys = list(state)
    return flux3_layout(count_blocks(keys, r"(?:^|\.)(?:txt_mode_blocks|mode_blocks\.\w+)\.(\d+)\."),
                        count_blocks(keys, r"(?:^|\.)single_transformer_blocks\.(\d+)\."),
                        any("target_timestep_embedder." in k for k in keys))
