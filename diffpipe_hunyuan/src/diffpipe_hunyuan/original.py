"""HunyuanVideo's original (Tencent) key layout, and ComfyUI's names, as a table of diffusers modules.

``double_blocks.N.img_attn_qkv`` is ``transformer_blocks.N.attn.to_q``, ``to_k``, ``to_v`` stacked along the output
rows, a single block's ``linear1`` is q, k, v and the MLP input, and the final adaLN linear holds its two halves in the
opposite order. ComfyUI's HunyuanVideo model names some block linears differently from Tencent's files
(``img_attn.qkv`` for ``img_attn_qkv``); the table carries both. Loading, per-stage loading, the ``single_file``
export and the ComfyUI LoRA export all read this one table (:mod:`diffpipe_core.parts.layout`).

diffusers' own converter assumes the full-size width (3072) when it splits ``linear1``; here the sizes come from the
config (or the tensors), so tiny and full-size checkpoints convert alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module, count_blocks

TTE, CE = "time_text_embed", "context_embedder"
#: ComfyUI's renames of Tencent's names, applied in this order to ``<module>.`` (its HunyuanVideo model's
#: ``process_unet_state_dict``): the names a file saved by ComfyUI holds; a q/k norm's ``weight`` is its ``scale``
COMFYUI_RENAMES = (
    ("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."),
    ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
    ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."),
    ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."),
    ("_mod.linear.", "_mod.lin."),
    ("_attn_qkv.", "_attn.qkv."),
    ("mlp.fc1.", "mlp.0."),
    ("mlp.fc2.", "mlp.2."),
    ("_attn_q_norm.", "_attn.norm.query_norm."),
    ("_attn_k_norm.", "_attn.norm.key_norm."),
    (".q_norm.", ".norm.query_norm."),
    (".k_norm.", ".norm.key_norm."),
    ("_attn_proj.", "_attn.proj."),
    (".modulation.linear.", ".modulation.lin."),
    ("_in.mlp.2.", "_in.out_layer."),
    ("_in.mlp.0.", "_in.in_layer."),
)
# the fused modules' parts, for reading the width off a LoRA (each reads the block's width)
FUSED_PARTS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")


def token_refiner(num_refiner: int, width: int, head: tuple[Module, ...] = ()) -> list[Module]:
    """The text token refiner (``txt_in``): its embedders, then its blocks (HunyuanVideo 1.0 and 1.5 alike);
    ``head``: modules listed between the embedders and the blocks."""
    qkv = (width,) * 3
    modules = [
        Module("txt_in.input_embedder", (f"{CE}.proj_in",)),
        Module("txt_in.t_embedder.mlp.0", (f"{CE}.{TTE}.timestep_embedder.linear_1",)),
        Module("txt_in.t_embedder.mlp.2", (f"{CE}.{TTE}.timestep_embedder.linear_2",)),
        Module("txt_in.c_embedder.linear_1", (f"{CE}.{TTE}.text_embedder.linear_1",)),
        Module("txt_in.c_embedder.linear_2", (f"{CE}.{TTE}.text_embedder.linear_2",)),
        *head,
    ]
    for i in range(num_refiner):
        o, d = f"txt_in.individual_token_refiner.blocks.{i}", f"{CE}.token_refiner.refiner_blocks.{i}"
        modules += [
            Module(f"{o}.norm1", (f"{d}.norm1",), comfy=None),
            Module(f"{o}.self_attn_qkv", (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"), qkv, comfy=None),
            Module(f"{o}.self_attn_proj", (f"{d}.attn.to_out.0",), comfy=None),
            Module(f"{o}.norm2", (f"{d}.norm2",), comfy=None),
            Module(f"{o}.mlp.fc1", (f"{d}.ff.net.0.proj",), comfy=None),
            Module(f"{o}.mlp.fc2", (f"{d}.ff.net.2",), comfy=None),
            Module(f"{o}.adaLN_modulation.1", (f"{d}.norm_out.linear",), comfy=None),
        ]
    return modules


def double_block(i: int, width: int, split_qkv: bool = False) -> list[Module]:
    """Double-stream block ``i`` (``double_blocks.i`` = ``transformer_blocks.i``). Its image and text q, k, v are
    one ``img_attn_qkv`` / ``txt_attn_qkv`` tensor (HunyuanVideo 1.0, and ComfyUI's names ``img_attn.qkv``), or with
    ``split_qkv`` three tensors each (``img_attn_q``, ``img_attn_k``, ``img_attn_v``: HunyuanVideo 1.5's files,
    for which ComfyUI's fused names do not apply)."""
    o, d, qkv = f"double_blocks.{i}", f"transformer_blocks.{i}", (width,) * 3
    img_qkv = (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v")
    txt_qkv = (f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj")
    if split_qkv:
        attention = [
            Module(f"{o}.{side}_attn_{x}", (part,), comfy=None)
            for side, parts in (("img", img_qkv), ("txt", txt_qkv))
            for x, part in zip("qkv", parts, strict=True)
        ]
    else:
        attention = [
            Module(f"{o}.img_attn_qkv", img_qkv, qkv, comfy=f"{o}.img_attn.qkv"),
            Module(f"{o}.txt_attn_qkv", txt_qkv, qkv, comfy=f"{o}.txt_attn.qkv"),
        ]
    return [
        Module(f"{o}.img_mod.linear", (f"{d}.norm1.linear",), comfy=f"{o}.img_mod.lin"),
        Module(f"{o}.txt_mod.linear", (f"{d}.norm1_context.linear",), comfy=f"{o}.txt_mod.lin"),
        *attention,
        Module(f"{o}.img_attn_proj", (f"{d}.attn.to_out.0",), comfy=f"{o}.img_attn.proj"),
        Module(f"{o}.txt_attn_proj", (f"{d}.attn.to_add_out",), comfy=f"{o}.txt_attn.proj"),
        Module(f"{o}.img_attn_q_norm", (f"{d}.attn.norm_q",), comfy=None),
        Module(f"{o}.img_attn_k_norm", (f"{d}.attn.norm_k",), comfy=None),
        Module(f"{o}.txt_attn_q_norm", (f"{d}.attn.norm_added_q",), comfy=None),
        Module(f"{o}.txt_attn_k_norm", (f"{d}.attn.norm_added_k",), comfy=None),
        Module(f"{o}.img_mlp.fc1", (f"{d}.ff.net.0.proj",), comfy=f"{o}.img_mlp.0"),
        Module(f"{o}.img_mlp.fc2", (f"{d}.ff.net.2",), comfy=f"{o}.img_mlp.2"),
        Module(f"{o}.txt_mlp.fc1", (f"{d}.ff_context.net.0.proj",), comfy=f"{o}.txt_mlp.0"),
        Module(f"{o}.txt_mlp.fc2", (f"{d}.ff_context.net.2",), comfy=f"{o}.txt_mlp.2"),
    ]


def single_block(i: int, width: int, mlp_ratio: float = 4.0) -> list[Module]:
    """Single-stream block ``i`` (``single_blocks.i`` = ``single_transformer_blocks.i``): ``linear1`` is q, k, v and
    the MLP input stacked, ``linear2`` the output projection (HunyuanVideo 1.0 and HunyuanImage-2.1 alike)."""
    o, d = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
    linear1 = (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v", f"{d}.proj_mlp")
    return [
        Module(f"{o}.modulation.linear", (f"{d}.norm.linear",), comfy=f"{o}.modulation.lin"),
        Module(f"{o}.linear1", linear1, (width, width, width, int(mlp_ratio * width))),
        Module(f"{o}.linear2", (f"{d}.proj_out",)),
        Module(f"{o}.q_norm", (f"{d}.attn.norm_q",), comfy=None),
        Module(f"{o}.k_norm", (f"{d}.attn.norm_k",), comfy=None),
    ]


#: the final norm's modulation and projection (the original holds the adaLN halves in the opposite order)
FINAL_LAYER = (
    Module("final_layer.linear", ("proj_out",), comfy=None),
    Module("final_layer.adaLN_modulation.1", ("norm_out.linear",), swap=True, comfy=None),
)


def layout(num_double: int, num_single: int, num_refiner: int, guidance: bool, width: int, mlp_ratio: float = 4.0):
    """Every module of a HunyuanVideo transformer of these sizes (``width``: heads x head dim; norms without
    weights have no entry)."""
    head = [
        Module("time_in.mlp.0", (f"{TTE}.timestep_embedder.linear_1",)),
        Module("time_in.mlp.2", (f"{TTE}.timestep_embedder.linear_2",)),
        Module("vector_in.in_layer", (f"{TTE}.text_embedder.linear_1",)),
        Module("vector_in.out_layer", (f"{TTE}.text_embedder.linear_2",)),
    ]
    if guidance:
        head += [
            Module("guidance_in.mlp.0", (f"{TTE}.guidance_embedder.linear_1",)),
            Module("guidance_in.mlp.2", (f"{TTE}.guidance_embedder.linear_2",)),
        ]
    modules = [Module("img_in.proj", ("x_embedder.proj",)), *token_refiner(num_refiner, width, tuple(head))]
    return tencent_table([*modules, *blocks_and_final(num_double, num_single, width, mlp_ratio)], "HunyuanVideo")


def blocks_and_final(num_double: int, num_single: int, width: int, mlp_ratio: float = 4.0) -> list[Module]:
    """The double blocks (q, k, v fused), the single blocks and the final layer (HunyuanVideo 1.0 and
    HunyuanImage-2.1 alike)."""
    modules = [m for i in range(num_double) for m in double_block(i, width)]
    modules += [m for i in range(num_single) for m in single_block(i, width, mlp_ratio)]
    return [*modules, *FINAL_LAYER]


def tencent_table(modules: list[Module], model: str) -> KeyTable:
    """``modules`` as Tencent's layout of ``model``'s transformer, read under the prefixes its files use."""
    return KeyTable(
        tuple(modules),
        name="original Tencent",
        model=f"{model} transformer",
        read_prefixes=("model.diffusion_model.", "diffusion_model.", "module."),
    )


def layout_for_config(c: Mapping[str, Any]) -> KeyTable:
    """The table of the transformer ``config`` (``transformer/config.json``) describes."""
    width = int(c["num_attention_heads"]) * int(c["attention_head_dim"])
    sizes = (int(c["num_layers"]), int(c["num_single_layers"]), int(c["num_refiner_layers"]))
    return layout(*sizes, bool(c["guidance_embeds"]), width, float(c.get("mlp_ratio", 4.0)))


def comfyui_layout(table: KeyTable) -> KeyTable:
    """``table`` (Tencent's names) in the names ComfyUI's HunyuanVideo model gives its modules, as a file ComfyUI
    saves holds them (``double_blocks.N.img_attn.qkv``, ``img_attn.norm.query_norm.scale``, ``img_mod.lin``,
    ``txt_in.t_embedder.in_layer``, ``time_in.in_layer``, ...)."""
    modules = []
    for module in table.modules:
        name = f"{module.original}."
        for old, new in COMFYUI_RENAMES:
            name = name.replace(old, new)
        name = name[:-1]
        params = (("scale", "weight"),) if name.endswith(("query_norm", "key_norm")) else module.params
        modules.append(replace(module, original=name, params=params))
    return replace(table, modules=tuple(modules), name="ComfyUI", read_prefixes=("model.model.", *table.read_prefixes))


def layouts_for_config(c: Mapping[str, Any]) -> list[KeyTable]:
    """Both layouts a ``diffusion_model`` file of this config may be in: Tencent's (the released and the repackaged
    files) and ComfyUI's own names (a file ComfyUI saved)."""
    table = layout_for_config(c)
    return [table, comfyui_layout(table)]


def layout_for_model_keys(keys: Iterable[str], width: int) -> KeyTable:
    """The table for a diffusers state dict (or LoRA module names) with these keys."""
    keys = list(keys)
    return layout(
        count_blocks(keys, r"transformer_blocks\.(\d+)\."),
        count_blocks(keys, r"single_transformer_blocks\.(\d+)\."),
        count_blocks(keys, rf"{CE}\.token_refiner\.refiner_blocks\.(\d+)\."),
        any(k.startswith(f"{TTE}.guidance_embedder.") for k in keys),
        width,
    )


def lora_width(state: Mapping[str, Any]) -> int:
    """The model's width as a peft LoRA state dict shows it: the input of an adapted part of a fused module (0 when
    none is adapted)."""
    found = (
        v
        for k, v in state.items()
        if k.endswith(".lora_A.weight") and k[: -len(".lora_A.weight")].endswith(FUSED_PARTS)
    )
    first = next(found, None)
    return int(first.shape[1]) if first is not None else 0


def model_width(state: Mapping[str, Any]) -> int:
    """The model's width as a diffusers state dict shows it (a ``to_q``'s rows)."""
    return int(next(v for k, v in state.items() if k.endswith("attn.to_q.weight")).shape[0])


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The table for a ComfyUI export of a peft LoRA: blocks counted from its modules, the width read from the input
    of an adapted part of a fused module."""
    return layout_for_model_keys(state, lora_width(state))


def diffusers_to_original(state: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers ``HunyuanVideoTransformer3DModel`` state dict in the original Tencent key layout."""
    return layout_for_model_keys(state, model_width(state)).to_original(state)


def layout_for_original_keys(state: Mapping[str, Any]) -> KeyTable:
    """The table for an original-layout state dict (keys optionally under a prefix), sized from its tensors."""
    bare = layout(0, 0, 0, False, 0)
    keys = [bare.strip(k) for k in state]
    width = next((int(v.shape[0]) for k, v in state.items() if bare.strip(k).endswith("img_attn_proj.weight")), 0)
    return layout(
        count_blocks(keys, r"double_blocks\.(\d+)\."),
        count_blocks(keys, r"single_blocks\.(\d+)\."),
        count_blocks(keys, r"txt_in\.individual_token_refiner\.blocks\.(\d+)\."),
        any(k.startswith("guidance_in.") for k in keys),
        width,
    )


def original_to_diffusers(state: Mapping[str, Any], source: str = "checkpoint") -> dict[str, Any]:
    """An original-layout HunyuanVideo transformer state dict (keys optionally under ``module.`` or
    ``model.diffusion_model.``) in diffusers' key layout, sized from its tensors."""
    return layout_for_original_keys(state).to_model(state, source)
