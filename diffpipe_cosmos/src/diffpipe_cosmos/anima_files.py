"""Anima's single-file layout, as ComfyUI loads ``anima-*.safetensors`` and diffusion-pipe saves full fine-tunes:
the Cosmos-Predict2 transformer in NVIDIA's names under ``net.`` (:mod:`diffpipe_cosmos.nvidia`), the LLM adapter
beside it under ``net.llm_adapter.`` in the names diffusers' ``AnimaTextConditioner`` uses too (so its table renames
nothing). The ComfyUI LoRA names both under ``diffusion_model.`` (``diffusion_model.blocks.0.self_attn.q_proj``,
``diffusion_model.llm_adapter.blocks.0.cross_attn.k_proj``), as diffusers' own converter
(``_convert_non_diffusers_anima_lora_to_diffusers``) reads them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module, count_blocks
from diffpipe_cosmos.nvidia import READ_PREFIXES, TRAINING_ONLY, layout

ADAPTER = "llm_adapter"
#: the linears of an LLM adapter block (its LoRA targets when the adapter trains)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTER_LINEARS = (*(f"{a}.{p}" for a in ("self_attn", "cross_attn") for p in ATTENTION), "mlp.0", "mlp.2")


def transformer_table(num_layers: int) -> KeyTable:
    """The transformer's part of the file: Predict2's NVIDIA table, the adapter's keys left to :func:`adapter_table`."""
    base = layout("predict2", num_layers)
    return replace(base, name="Anima (ComfyUI)", model="Anima transformer", skip=rf"{TRAINING_ONLY}|^{ADAPTER}\.")


def adapter_table() -> KeyTable:
    """The LLM adapter's part of the file (``net.llm_adapter.*``): the text conditioner's own names under that
    prefix."""
    prefixes = tuple(f"{p}{ADAPTER}." for p in (*READ_PREFIXES, ""))
    return KeyTable((), "Anima (ComfyUI)", "Anima LLM adapter", prefixes, f"net.{ADAPTER}.", passthrough=True)


def layout_for_config(config: dict[str, Any]) -> KeyTable:
    """The transformer table of ``transformer/config.json``."""
    return transformer_table(int(config.get("num_layers", 28)))


def lora_layout(state: Any) -> KeyTable:
    """The table of a ComfyUI export of a peft LoRA over the transformer and (``text_conditioner.``) the adapter:
    NVIDIA's block names, and the adapter's linears under ``llm_adapter.``."""
    keys = list(state)
    table = transformer_table(count_blocks(keys, r"transformer_blocks\.(\d+)\."))
    blocks = count_blocks(keys, r"text_conditioner\.blocks\.(\d+)\.")
    adapter = tuple(
        Module(f"{ADAPTER}.blocks.{i}.{name}", (f"text_conditioner.blocks.{i}.{name}",))
        for i in range(blocks) for name in ADAPTER_LINEARS
    )
    return replace(table, modules=table.modules + adapter)
