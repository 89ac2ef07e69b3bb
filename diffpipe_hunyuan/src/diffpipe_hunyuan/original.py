"""HunyuanVideo's original (Tencent) key layout, ComfyUI's names, and their diffusers counterparts.

One table, :func:`module_maps`, says which diffusers modules make up each original module, in order
(``double_blocks.N.img_attn_qkv`` = ``transformer_blocks.N.attn.to_q``, ``to_k``, ``to_v`` stacked along
the output dimension) and, for the block linears a LoRA adapts, the name ComfyUI's HunyuanVideo model gives
the module (``double_blocks.N.img_attn.qkv``). Weight conversion both ways and the ComfyUI LoRA export use
it, so they cannot drift apart.

diffusers' ``convert_hunyuan_video_transformer_to_diffusers`` assumes the full-size inner dim (3072) when it
splits ``single_blocks.N.linear1``; here the sizes come from the tensors, so tiny and full-size checkpoints
convert alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

ORIGINAL_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "module.")
PARAMS = ("weight", "bias")
Transform = Callable[[torch.Tensor], torch.Tensor]
KeyTargets = list[tuple[str, "Transform | None"]]


@dataclass(frozen=True)
class ModuleMap:
    """``original`` (a module path in Tencent's layout) is ``parts`` (diffusers module paths) stacked along
    dim 0. ``comfy``: ComfyUI's name for it, where a LoRA may target it. ``swap``: the final adaLN linear,
    whose shift/scale halves are in the opposite order in the original."""

    original: str
    parts: tuple[str, ...]
    comfy: str | None = None
    swap: bool = False


def module_maps(num_double: int, num_single: int, num_refiner: int, guidance: bool) -> list[ModuleMap]:
    """Every module of a HunyuanVideo transformer of these sizes (norms without weights have no entry)."""
    tte, ce = "time_text_embed", "context_embedder"
    maps = [
        ModuleMap("img_in.proj", ("x_embedder.proj",)),
        ModuleMap("txt_in.input_embedder", (f"{ce}.proj_in",)),
        ModuleMap("txt_in.t_embedder.mlp.0", (f"{ce}.{tte}.timestep_embedder.linear_1",)),
        ModuleMap("txt_in.t_embedder.mlp.2", (f"{ce}.{tte}.timestep_embedder.linear_2",)),
        ModuleMap("txt_in.c_embedder.linear_1", (f"{ce}.{tte}.text_embedder.linear_1",)),
        ModuleMap("txt_in.c_embedder.linear_2", (f"{ce}.{tte}.text_embedder.linear_2",)),
        ModuleMap("time_in.mlp.0", (f"{tte}.timestep_embedder.linear_1",)),
        ModuleMap("time_in.mlp.2", (f"{tte}.timestep_embedder.linear_2",)),
        ModuleMap("vector_in.in_layer", (f"{tte}.text_embedder.linear_1",)),
        ModuleMap("vector_in.out_layer", (f"{tte}.text_embedder.linear_2",)),
    ]
    if guidance:
        maps += [
            ModuleMap("guidance_in.mlp.0", (f"{tte}.guidance_embedder.linear_1",)),
            ModuleMap("guidance_in.mlp.2", (f"{tte}.guidance_embedder.linear_2",)),
        ]
    for i in range(num_refiner):
        o, d = f"txt_in.individual_token_refiner.blocks.{i}", f"{ce}.token_refiner.refiner_blocks.{i}"
        maps += [
            ModuleMap(f"{o}.norm1", (f"{d}.norm1",)),
            ModuleMap(f"{o}.self_attn_qkv", (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v")),
            ModuleMap(f"{o}.self_attn_proj", (f"{d}.attn.to_out.0",)),
            ModuleMap(f"{o}.norm2", (f"{d}.norm2",)),
            ModuleMap(f"{o}.mlp.fc1", (f"{d}.ff.net.0.proj",)),
            ModuleMap(f"{o}.mlp.fc2", (f"{d}.ff.net.2",)),
            ModuleMap(f"{o}.adaLN_modulation.1", (f"{d}.norm_out.linear",)),
        ]
    for i in range(num_double):
        o, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        maps += [
            ModuleMap(f"{o}.img_mod.linear", (f"{d}.norm1.linear",), f"{o}.img_mod.lin"),
            ModuleMap(f"{o}.txt_mod.linear", (f"{d}.norm1_context.linear",), f"{o}.txt_mod.lin"),
            ModuleMap(f"{o}.img_attn_qkv", (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"), f"{o}.img_attn.qkv"),
            ModuleMap(
                f"{o}.txt_attn_qkv",
                (f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"),
                f"{o}.txt_attn.qkv",
            ),
            ModuleMap(f"{o}.img_attn_proj", (f"{d}.attn.to_out.0",), f"{o}.img_attn.proj"),
            ModuleMap(f"{o}.txt_attn_proj", (f"{d}.attn.to_add_out",), f"{o}.txt_attn.proj"),
            ModuleMap(f"{o}.img_attn_q_norm", (f"{d}.attn.norm_q",)),
            ModuleMap(f"{o}.img_attn_k_norm", (f"{d}.attn.norm_k",)),
            ModuleMap(f"{o}.txt_attn_q_norm", (f"{d}.attn.norm_added_q",)),
            ModuleMap(f"{o}.txt_attn_k_norm", (f"{d}.attn.norm_added_k",)),
            ModuleMap(f"{o}.img_mlp.fc1", (f"{d}.ff.net.0.proj",), f"{o}.img_mlp.0"),
            ModuleMap(f"{o}.img_mlp.fc2", (f"{d}.ff.net.2",), f"{o}.img_mlp.2"),
            ModuleMap(f"{o}.txt_mlp.fc1", (f"{d}.ff_context.net.0.proj",), f"{o}.txt_mlp.0"),
            ModuleMap(f"{o}.txt_mlp.fc2", (f"{d}.ff_context.net.2",), f"{o}.txt_mlp.2"),
        ]
    for i in range(num_single):
        o, d = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        maps += [
            ModuleMap(f"{o}.modulation.linear", (f"{d}.norm.linear",), f"{o}.modulation.lin"),
            ModuleMap(
                f"{o}.linear1",
                (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v", f"{d}.proj_mlp"),
                f"{o}.linear1",
            ),
            ModuleMap(f"{o}.linear2", (f"{d}.proj_out",), f"{o}.linear2"),
            ModuleMap(f"{o}.q_norm", (f"{d}.attn.norm_q",)),
            ModuleMap(f"{o}.k_norm", (f"{d}.attn.norm_k",)),
        ]
    maps += [
        ModuleMap("final_layer.linear", ("proj_out",)),
        ModuleMap("final_layer.adaLN_modulation.1", ("norm_out.linear",), swap=True),
    ]
    return maps


def count_blocks(keys: list[str], pattern: str) -> int:
    """``max(N) + 1`` over the keys matching ``pattern`` (one group: the block index), 0 if none match."""
    found = {int(m.group(1)) for k in keys if (m := re.match(pattern, k))}
    return max(found) + 1 if found else 0


def maps_for_diffusers_keys(keys: list[str]) -> list[ModuleMap]:
    """The table for a diffusers state dict (or LoRA module names) with these keys."""
    return module_maps(
        count_blocks(keys, r"transformer_blocks\.(\d+)\."),
        count_blocks(keys, r"single_transformer_blocks\.(\d+)\."),
        count_blocks(keys, r"context_embedder\.token_refiner\.refiner_blocks\.(\d+)\."),
        any(k.startswith("time_text_embed.guidance_embedder.") for k in keys),
    )


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def _part(index: int, count: int, width: int | None) -> Transform:
    """Part ``index`` of ``count`` stacked along dim 0: equal parts, or (``width`` given, a single block's
    ``linear1``) q, k and v of ``width`` rows each, then the MLP (the rest)."""

    def take(t: torch.Tensor) -> torch.Tensor:
        sizes = [width] * 3 + [t.shape[0] - 3 * width] if width is not None else [t.shape[0] // count] * count
        return torch.split(t, sizes, dim=0)[index].contiguous()

    return take


def key_targets(maps: list[ModuleMap], width: int) -> dict[str, KeyTargets]:
    """For every original key (no prefix) of a model made of ``maps``: the diffusers tensors made from it, each
    with the transform that cuts it out of the original tensor (None: as is). ``width`` (heads x head dim) is
    the size of q, k and v in a single block's fused ``linear1``; the fused qkv tensors split in equal thirds."""
    table: dict[str, KeyTargets] = {}
    for m in maps:
        for param in PARAMS:
            if len(m.parts) == 1:
                table[f"{m.original}.{param}"] = [(f"{m.parts[0]}.{param}", swap_halves if m.swap else None)]
                continue
            part_width = width if m.original.endswith("linear1") else None
            table[f"{m.original}.{param}"] = [
                (f"{p}.{param}", _part(i, len(m.parts), part_width)) for i, p in enumerate(m.parts)
            ]
    return table


def diffusers_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers ``HunyuanVideoTransformer3DModel`` state dict in the original Tencent key layout."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for m in maps_for_diffusers_keys(list(state)):
        for param in PARAMS:
            names = [f"{p}.{param}" for p in m.parts]
            present = [n for n in names if n in state]
            if not present:
                continue
            if len(present) != len(names):
                missing = sorted(set(names) - set(present))
                raise KeyError(f"diffusers HunyuanVideo state dict lacks {missing[0]!r} (for {m.original}.{param})")
            value = torch.cat([state[n] for n in names], dim=0)
            out[f"{m.original}.{param}"] = swap_halves(value) if m.swap else value
            used.update(names)
    extra = sorted(set(state) - used)
    if extra:
        raise KeyError(
            f"diffusers HunyuanVideo state dict has {len(extra)} keys with no original name, e.g. {extra[:3]}"
        )
    return out


def strip_prefix(key: str) -> str:
    for prefix in ORIGINAL_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def maps_for_original_keys(keys: list[str]) -> list[ModuleMap]:
    return module_maps(
        count_blocks(keys, r"double_blocks\.(\d+)\."),
        count_blocks(keys, r"single_blocks\.(\d+)\."),
        count_blocks(keys, r"txt_in\.individual_token_refiner\.blocks\.(\d+)\."),
        any(k.startswith("guidance_in.") for k in keys),
    )


def original_to_diffusers(state: dict[str, torch.Tensor], source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """An original-layout HunyuanVideo transformer state dict (keys optionally under ``module.`` or
    ``model.diffusion_model.``) in diffusers' key layout. Unknown keys, or a module without its weight,
    raise a KeyError naming ``source`` and the key."""
    state = {strip_prefix(k): v for k, v in state.items()}
    maps = maps_for_original_keys(list(state))
    for m in maps:
        if f"{m.original}.weight" not in state:
            raise KeyError(
                f"{source}: missing key {m.original + '.weight'!r}; is this a HunyuanVideo transformer in the "
                "original layout?"
            )
    linear1 = next((v for k, v in state.items() if re.fullmatch(r"single_blocks\.\d+\.linear1\.weight", k)), None)
    table = key_targets(maps, linear1.shape[1] if linear1 is not None else 0)
    extra = sorted(set(state) - set(table))
    if extra:
        raise KeyError(f"{source}: {len(extra)} unexpected keys for a HunyuanVideo transformer, e.g. {extra[:3]}")
    return {
        name: transform(state[key]) if transform else state[key]
        for key, targets in table.items()
        if key in state
        for name, transform in targets
    }


def single_file_key_map(transformer_config: dict) -> Callable[[str], KeyTargets | None]:
    """The per-stage loading key map of an original-layout single file (``diffusion_model_weights``) for a
    transformer with this diffusers config: a file key (with or without a prefix) -> the diffusers tensors it
    makes, so a stage splits only its own blocks' fused tensors; None for a key that is not the model's."""
    c = transformer_config
    maps = module_maps(
        int(c["num_layers"]), int(c["num_single_layers"]), int(c["num_refiner_layers"]), bool(c["guidance_embeds"])
    )
    table = key_targets(maps, int(c["num_attention_heads"]) * int(c["attention_head_dim"]))
    return lambda key: table.get(strip_prefix(key))
