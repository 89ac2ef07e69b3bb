"""Krea 2's original key layout (Krea's checkpoints, ``krea2_raw.safetensors`` / ``krea2_turbo*.safetensors`` as
ComfyUI loads them: its Krea 2 model uses these names) as a table of diffusers modules.

Every module is a rename: ``first`` is ``img_in``, ``tmlp.0/2`` the time MLP (``time_embed.linear_1/2``), ``tproj.1``
``time_mod_proj``, ``txtmlp.0/1/3`` the text projection's norm and linears (``txt_in``), ``txtfusion.*`` the text
fusion (``text_fusion.*``), ``blocks.N`` the single-stream blocks (``transformer_blocks.N``) and ``last`` the final
layer; inside a block ``attn.wq/wk/wv/wo/gate`` are ``attn.to_q/to_k/to_v/to_out.0/to_gate``, ``mlp`` is ``ff``,
``prenorm`` / ``postnorm`` / ``attn.qknorm.qnorm`` / ``attn.qknorm.knorm`` (weights named ``scale``) are ``norm1`` /
``norm2`` / ``attn.norm_q`` / ``attn.norm_k``, and ``mod.lin`` (one ``6 * D`` vector) is the block's ``(6, D)``
``scale_shift_table``. This is the mapping of diffusers' ``convert_krea2_transformer_checkpoint_to_diffusers`` (a
test checks the two agree); ComfyUI's LoRA key map (``krea2_to_diffusers``) names the same linears.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module, count_blocks

SCALE = (("scale", "weight"),)
ATTENTION = {"wq": "to_q", "wk": "to_k", "wv": "to_v", "wo": "to_out.0", "gate": "to_gate"}
MLP = ("gate", "up", "down")


def block(original: str, model: str) -> list[Module]:
    """The modules of one block (a single-stream block, or a text fusion block: the same layout without ``mod``)."""
    modules = [Module(f"{original}.attn.{o}", (f"{model}.attn.{m}",)) for o, m in ATTENTION.items()]
    modules += [Module(f"{original}.mlp.{o}", (f"{model}.ff.{o}",)) for o in MLP]
    modules += [
        Module(f"{original}.prenorm", (f"{model}.norm1",), params=SCALE, comfy=None),
        Module(f"{original}.postnorm", (f"{model}.norm2",), params=SCALE, comfy=None),
        Module(f"{original}.attn.qknorm.qnorm", (f"{model}.attn.norm_q",), params=SCALE, comfy=None),
        Module(f"{original}.attn.qknorm.knorm", (f"{model}.attn.norm_k",), params=SCALE, comfy=None),
    ]
    return modules


def layout(num_layers: int, layerwise: int = 2, refiner: int = 2) -> KeyTable:
    """Every module of a Krea 2 transformer of ``num_layers`` blocks (and ``layerwise`` / ``refiner`` text fusion
    blocks)."""
    modules = [
        Module("first", ("img_in",)),
        Module("tmlp.0", ("time_embed.linear_1",)),
        Module("tmlp.2", ("time_embed.linear_2",)),
        Module("tproj.1", ("time_mod_proj",)),
        Module("txtmlp.0", ("txt_in.norm",), params=SCALE, comfy=None),
        Module("txtmlp.1", ("txt_in.linear_1",)),
        Module("txtmlp.3", ("txt_in.linear_2",)),
        Module("txtfusion.projector", ("text_fusion.projector",)),
        Module("last.linear", ("final_layer.linear",)),
        Module("last.norm", ("final_layer.norm",), params=SCALE, comfy=None),
        Module("last.modulation", ("final_layer",), params=(("lin", "scale_shift_table"),), comfy=None),
    ]
    for kind, count in (("layerwise_blocks", layerwise), ("refiner_blocks", refiner)):
        for i in range(count):
            modules += block(f"txtfusion.{kind}.{i}", f"text_fusion.{kind}.{i}")
    for i in range(num_layers):
        b, d = f"blocks.{i}", f"transformer_blocks.{i}"
        modules += block(b, d)
        modules.append(Module(f"{b}.mod", (d,), params=(("lin", "scale_shift_table"),), form="flat6", comfy=None))
    return KeyTable(tuple(modules), name="Krea 2 (ComfyUI)", model="Krea 2 transformer")


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    """The table of the transformer ``config`` (``transformer/config.json``) describes."""
    return layout(int(config.get("num_layers", 28)), int(config.get("num_layerwise_text_blocks", 2)),
                  int(config.get("num_refiner_text_blocks", 2)))


def layout_for_keys(keys: Any) -> KeyTable:
    """The table for state-dict keys or LoRA module names of either layout (blocks counted from them)."""
    keys = list(keys)
    blocks = count_blocks(keys, r"(?:.*\.)?(?:transformer_blocks|blocks)\.(\d+)\.")
    layerwise = count_blocks(keys, r"(?:.*\.)?(?:text_fusion|txtfusion)\.layerwise_blocks\.(\d+)\.")
    refiner = count_blocks(keys, r"(?:.*\.)?(?:text_fusion|txtfusion)\.refiner_blocks\.(\d+)\.")
    return layout(blocks, max(layerwise, 2), max(refiner, 2))


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The table for a ComfyUI export of a peft LoRA (blocks counted from its module names)."""
    return layout_for_keys(state)
