"""NVIDIA's original Cosmos key layouts (1.0 and Predict2) as tables of diffusers modules.

Neither layout fuses tensors, so each entry renames one module (whatever its parameters). Original checkpoints
keep the network under ``net.`` and carry training-only tensors the diffusers model does not have (``logvar.*``,
``pos_embedder.seq``, ``accum_*`` counters, TransformerEngine ``_extra_state``): the table skips them. Loading,
per-stage loading, the ``single_file`` export and the ComfyUI LoRA export all read this one table
(:mod:`diffpipe_core.parts.layout`). diffusers 0.42's ``convert_cosmos_transformer_checkpoint_to_diffusers``
applies the Predict2 table to 1.0 files (it empties the checkpoint before testing which version it holds).
"""

from __future__ import annotations

from typing import Literal

from diffpipe_core.parts.layout import KeyTable, Module

Variant = Literal["1.0", "predict2"]
TRAINING_ONLY = r"^(logvar\.|pos_embedder\.|accum_)|_extra_state$"
#: NVIDIA's files keep the network under ``net.``; a checkpoint ComfyUI saves holds it under ``model.diffusion_model.``
READ_PREFIXES = ("net.", "model.diffusion_model.", "diffusion_model.")
_ATTN = (("q_proj", "to_q"), ("k_proj", "to_k"), ("v_proj", "to_v"), ("output_proj", "to_out.0"))


def _block_1_0(i: int) -> list[tuple[str, str]]:
    nb, db = f"blocks.block{i}", f"transformer_blocks.{i}"
    pairs = []
    for k, attn in ((0, "attn1"), (1, "attn2")):
        a = f"{nb}.blocks.{k}.block.attn"
        pairs += [(f"{a}.{n}.0", f"{db}.{attn}.{n}") for n in ("to_q", "to_k", "to_v")]
        pairs += [(f"{a}.to_q.1", f"{db}.{attn}.norm_q"), (f"{a}.to_k.1", f"{db}.{attn}.norm_k")]
        pairs += [(f"{a}.to_out.0", f"{db}.{attn}.to_out.0")]
    pairs += [(f"{nb}.blocks.2.block.layer1", f"{db}.ff.net.0.proj"), (f"{nb}.blocks.2.block.layer2", f"{db}.ff.net.2")]
    for k in range(3):
        pairs += [(f"{nb}.blocks.{k}.adaLN_modulation.{j}", f"{db}.norm{k + 1}.linear_{j}") for j in (1, 2)]
    return pairs


def _block_predict2(i: int) -> list[tuple[str, str]]:
    nb, db = f"blocks.{i}", f"transformer_blocks.{i}"
    pairs = []
    for native, attn in (("self_attn", "attn1"), ("cross_attn", "attn2")):
        names = (*_ATTN, ("q_norm", "norm_q"), ("k_norm", "norm_k"))
        pairs += [(f"{nb}.{native}.{n}", f"{db}.{attn}.{d}") for n, d in names]
    pairs += [(f"{nb}.mlp.layer1", f"{db}.ff.net.0.proj"), (f"{nb}.mlp.layer2", f"{db}.ff.net.2")]
    for k, native in enumerate(("self_attn", "cross_attn", "mlp")):
        pairs += [(f"{nb}.adaln_modulation_{native}.{j}", f"{db}.norm{k + 1}.linear_{j}") for j in (1, 2)]
    return pairs


def layout(variant: Variant, num_layers: int) -> KeyTable:
    """Every module of a Cosmos transformer of this generation with ``num_layers`` blocks."""
    final = "final_layer.adaLN_modulation" if variant == "1.0" else "final_layer.adaln_modulation"
    pairs = [
        ("x_embedder.proj.1", "patch_embed.proj"),
        ("extra_pos_embedder", "learnable_pos_embed"),
        ("t_embedder.1.linear_1", "time_embed.t_embedder.linear_1"),
        ("t_embedder.1.linear_2", "time_embed.t_embedder.linear_2"),
        ("affline_norm" if variant == "1.0" else "t_embedding_norm", "time_embed.norm"),
        (f"{final}.1", "norm_out.linear_1"),
        (f"{final}.2", "norm_out.linear_2"),
        ("final_layer.linear", "proj_out"),
    ]
    block = _block_1_0 if variant == "1.0" else _block_predict2
    for i in range(num_layers):
        pairs += block(i)
    modules = tuple(Module(original, (model,), params=None) for original, model in pairs)
    name = f"NVIDIA Cosmos {variant}"
    return KeyTable(modules, name, "Cosmos transformer", READ_PREFIXES, "net.", skip=TRAINING_ONLY)

