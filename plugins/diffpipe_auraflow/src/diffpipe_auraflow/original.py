"""AuraFlow's original key layout (fal's ``aura_flow_0.3.safetensors``, Pony V7's ``pony-v7-base.safetensors``, as
ComfyUI loads them: its AuraFlow MMDiT uses these names) as a table of diffusers modules.

Every module is a plain rename: ``double_layers.N.attn.w2q/w2k/w2v/w2o`` are a joint block's image-side
``attn.to_q/to_k/to_v/to_out.0`` and ``w1q/w1k/w1v/w1o`` its text side (``add_q_proj``, ..., ``to_add_out``),
``mlpX``/``mlpC`` the two MLPs (``c_fc1``, ``c_fc2``, ``c_proj`` = ``linear_1``, ``linear_2``, ``out_projection``),
``modX``/``modC`` the adaLN linears; ``single_layers.N`` likewise with ``w1*``, ``mlp`` and ``modCX``;
``init_x_linear`` / ``positional_encoding`` the patch embedding and its position table, ``cond_seq_linear`` the
caption projection, ``t_embedder.mlp.0/2`` the timestep MLP, ``final_linear`` the output projection and ``modF.1``
the final adaLN linear, whose shift and scale halves are in the opposite order. This is the mapping of diffusers'
``convert_auraflow_transformer_checkpoint_to_diffusers`` (a test checks the two agree).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module, count_blocks

MLP = {"c_fc1": "linear_1", "c_fc2": "linear_2", "c_proj": "out_projection"}
IMAGE_ATTENTION = {"w2q": "to_q", "w2k": "to_k", "w2v": "to_v", "w2o": "to_out.0"}
TEXT_ATTENTION = {"w1q": "add_q_proj", "w1k": "add_k_proj", "w1v": "add_v_proj", "w1o": "to_add_out"}
SINGLE_ATTENTION = {"w1q": "to_q", "w1k": "to_k", "w1v": "to_v", "w1o": "to_out.0"}


def layout(num_joint: int, num_single: int) -> KeyTable:
    """Every module of an AuraFlow transformer of ``num_joint`` joint (MMDiT) and ``num_single`` single blocks."""
    modules = [
        Module("", ("pos_embed",), params=(("positional_encoding", "pos_embed"),), comfy=None),
        Module("init_x_linear", ("pos_embed.proj",)),
        Module("cond_seq_linear", ("context_embedder",)),
        Module("t_embedder.mlp.0", ("time_step_proj.linear_1",)),
        Module("t_embedder.mlp.2", ("time_step_proj.linear_2",)),
    ]
    for i in range(num_joint):
        b, d = f"double_layers.{i}", f"joint_transformer_blocks.{i}"
        attention = {**IMAGE_ATTENTION, **TEXT_ATTENTION}
        modules += [Module(f"{b}.attn.{o}", (f"{d}.attn.{m}",)) for o, m in attention.items()]
        modules += [Module(f"{b}.mlpX.{o}", (f"{d}.ff.{m}",)) for o, m in MLP.items()]
        modules += [Module(f"{b}.mlpC.{o}", (f"{d}.ff_context.{m}",)) for o, m in MLP.items()]
        modules += [Module(f"{b}.modX.1", (f"{d}.norm1.linear",))]
        modules += [Module(f"{b}.modC.1", (f"{d}.norm1_context.linear",))]
    for i in range(num_single):
        b, d = f"single_layers.{i}", f"single_transformer_blocks.{i}"
        modules += [Module(f"{b}.attn.{o}", (f"{d}.attn.{m}",)) for o, m in SINGLE_ATTENTION.items()]
        modules += [Module(f"{b}.mlp.{o}", (f"{d}.ff.{m}",)) for o, m in MLP.items()]
        modules.append(Module(f"{b}.modCX.1", (f"{d}.norm1.linear",)))
    modules += [
        Module("final_linear", ("proj_out",)),
        Module("modF.1", ("norm_out.linear",), swap=True),
    ]
    # register_tokens keeps its name
    return KeyTable(tuple(modules), name="original AuraFlow", model="AuraFlow transformer", passthrough=True)


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    """The table of the transformer ``config`` (``transformer/config.json``) describes."""
    return layout(int(config.get("num_mmdit_layers", 4)), int(config.get("num_single_dit_layers", 32)))


def layout_for_keys(keys: Any) -> KeyTable:
    """The table for state-dict keys or LoRA module names of either layout (blocks counted from them)."""
    keys = list(keys)
    joint = count_blocks(keys, r"(?:.*\.)?(?:joint_transformer_blocks|double_layers)\.(\d+)\.")
    single = count_blocks(keys, r"(?:.*\.)?(?:single_transformer_blocks|single_layers)\.(\d+)\.")
    return layout(joint, single)


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The table for a ComfyUI export of a peft LoRA (blocks counted from its module names)."""
    return layout_for_keys(state)


def diffusers_to_original(state: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers ``AuraFlowTransformer2DModel`` state dict in the original key layout."""
    return layout_for_keys(state).to_original(state)
