"""The original (Black Forest Labs) Flux key layout and its diffusers counterpart.

One table, :func:`module_pairs`, says which diffusers modules make up each BFL module, in order
(``double_blocks.N.img_attn.qkv`` = ``transformer_blocks.N.attn.to_q``, ``to_k``, ``to_v`` stacked
along the output dimension). Weight conversion both ways and the ComfyUI LoRA export use it, so the
three cannot drift apart.

diffusers' own ``convert_flux_transformer_checkpoint_to_diffusers`` assumes the full-size inner dim
(3072) when it splits ``single_blocks.N.linear1``; this module derives the sizes from the tensors,
so tiny test models and full-size checkpoints convert alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

Kind = Literal["linear", "norm", "swap"]
BFL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


@dataclass(frozen=True)
class ModulePair:
    """``bfl`` (a BFL module path) is ``parts`` (diffusers module paths) stacked along dim 0.

    ``kind``: ``linear`` (weight + bias), ``norm`` (BFL ``.scale`` = diffusers ``.weight``) or ``swap``
    (the final adaLN linear, whose shift/scale halves are in the opposite order in BFL).
    """

    bfl: str
    parts: tuple[str, ...]
    kind: Kind = "linear"


def module_pairs(num_double: int, num_single: int, guidance: bool) -> list[ModulePair]:
    """Every module of a Flux transformer with ``num_double`` double and ``num_single`` single blocks."""
    tte = "time_text_embed"
    pairs = [
        ModulePair("img_in", ("x_embedder",)),
        ModulePair("txt_in", ("context_embedder",)),
        ModulePair("time_in.in_layer", (f"{tte}.timestep_embedder.linear_1",)),
        ModulePair("time_in.out_layer", (f"{tte}.timestep_embedder.linear_2",)),
        ModulePair("vector_in.in_layer", (f"{tte}.text_embedder.linear_1",)),
        ModulePair("vector_in.out_layer", (f"{tte}.text_embedder.linear_2",)),
    ]
    if guidance:
        pairs += [
            ModulePair("guidance_in.in_layer", (f"{tte}.guidance_embedder.linear_1",)),
            ModulePair("guidance_in.out_layer", (f"{tte}.guidance_embedder.linear_2",)),
        ]
    for i in range(num_double):
        b, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        pairs += [
            ModulePair(f"{b}.img_mod.lin", (f"{d}.norm1.linear",)),
            ModulePair(f"{b}.txt_mod.lin", (f"{d}.norm1_context.linear",)),
            ModulePair(f"{b}.img_attn.qkv", (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v")),
            ModulePair(f"{b}.txt_attn.qkv", (f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj")),
            ModulePair(f"{b}.img_attn.proj", (f"{d}.attn.to_out.0",)),
            ModulePair(f"{b}.txt_attn.proj", (f"{d}.attn.to_add_out",)),
            ModulePair(f"{b}.img_attn.norm.query_norm", (f"{d}.attn.norm_q",), "norm"),
            ModulePair(f"{b}.img_attn.norm.key_norm", (f"{d}.attn.norm_k",), "norm"),
            ModulePair(f"{b}.txt_attn.norm.query_norm", (f"{d}.attn.norm_added_q",), "norm"),
            ModulePair(f"{b}.txt_attn.norm.key_norm", (f"{d}.attn.norm_added_k",), "norm"),
            ModulePair(f"{b}.img_mlp.0", (f"{d}.ff.net.0.proj",)),
            ModulePair(f"{b}.img_mlp.2", (f"{d}.ff.net.2",)),
            ModulePair(f"{b}.txt_mlp.0", (f"{d}.ff_context.net.0.proj",)),
            ModulePair(f"{b}.txt_mlp.2", (f"{d}.ff_context.net.2",)),
        ]
    for i in range(num_single):
        b, d = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        pairs += [
            ModulePair(f"{b}.modulation.lin", (f"{d}.norm.linear",)),
            ModulePair(f"{b}.linear1", (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v", f"{d}.proj_mlp")),
            ModulePair(f"{b}.linear2", (f"{d}.proj_out",)),
            ModulePair(f"{b}.norm.query_norm", (f"{d}.attn.norm_q",), "norm"),
            ModulePair(f"{b}.norm.key_norm", (f"{d}.attn.norm_k",), "norm"),
        ]
    pairs += [
        ModulePair("final_layer.linear", ("proj_out",)),
        ModulePair("final_layer.adaLN_modulation.1", ("norm_out.linear",), "swap"),
    ]
    return pairs


def _count(keys: list[str], pattern: str) -> int:
    found = {int(m.group(1)) for k in keys if (m := re.match(pattern, k))}
    return max(found) + 1 if found else 0


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def _params(kind: Kind) -> tuple[tuple[str, str], ...]:
    """(bfl parameter, diffusers parameter) names of a module kind."""
    return (("scale", "weight"),) if kind == "norm" else (("weight", "weight"), ("bias", "bias"))


def diffusers_to_bfl(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers ``FluxTransformer2DModel`` state dict in the original BFL key layout."""
    keys = list(state)
    pairs = module_pairs(
        _count(keys, r"transformer_blocks\.(\d+)\."),
        _count(keys, r"single_transformer_blocks\.(\d+)\."),
        any(k.startswith("time_text_embed.guidance_embedder.") for k in keys),
    )
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for pair in pairs:
        for bfl_param, d_param in _params(pair.kind):
            names = [f"{p}.{d_param}" for p in pair.parts]
            missing = [n for n in names if n not in state]
            if missing:
                raise KeyError(f"diffusers Flux state dict lacks {missing[0]!r} (needed for {pair.bfl}.{bfl_param})")
            value = torch.cat([state[n] for n in names], dim=0)
            out[f"{pair.bfl}.{bfl_param}"] = swap_halves(value) if pair.kind == "swap" else value
            used.update(names)
    extra = sorted(set(keys) - used)
    if extra:
        raise KeyError(f"diffusers Flux state dict has {len(extra)} keys with no BFL counterpart, e.g. {extra[:3]}")
    return out


def strip_bfl_prefix(key: str) -> str:
    for prefix in BFL_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


Transform = Callable[[torch.Tensor], torch.Tensor]


def _piece(index: int, count: int, inner: int | None) -> Transform:
    """Part ``index`` of ``count`` stacked along dim 0: equal parts, or (``inner`` given, a single block's
    ``linear1``) q, k and v of ``inner`` rows each, then the MLP (the rest)."""

    def take(t: torch.Tensor) -> torch.Tensor:
        sizes = [inner] * 3 + [t.shape[0] - 3 * inner] if inner is not None else [t.shape[0] // count] * count
        return torch.split(t, sizes, dim=0)[index].contiguous()

    return take


def bfl_key_targets(pairs: list[ModulePair], inner_dim: int) -> dict[str, list[tuple[str, Transform | None]]]:
    """For every BFL key (no prefix) of a model made of ``pairs``: the diffusers keys made from it, each with
    the transform that cuts it out of the BFL tensor (None: the tensor as is). ``inner_dim`` is the attention
    width (heads x head dim), the size of q, k and v in a single block's fused ``linear1``."""
    table: dict[str, list[tuple[str, Transform | None]]] = {}
    for pair in pairs:
        inner = inner_dim if pair.bfl.endswith("linear1") else None
        for bfl_param, d_param in _params(pair.kind):
            name = f"{pair.bfl}.{bfl_param}"
            if len(pair.parts) == 1:
                table[name] = [(f"{pair.parts[0]}.{d_param}", swap_halves if pair.kind == "swap" else None)]
            else:
                count = len(pair.parts)
                table[name] = [(f"{p}.{d_param}", _piece(i, count, inner)) for i, p in enumerate(pair.parts)]
    return table


def bfl_key_map(
    num_double: int, num_single: int, guidance: bool, inner_dim: int
) -> Callable[[str], list[tuple[str, Transform | None]] | None]:
    """The per-stage loading key map of a BFL single file (``diffusion_model_weights``): a file key (with or
    without the ``model.diffusion_model.`` prefix) -> the diffusers tensors it makes, None for a key that is
    not a Flux transformer's."""
    table = bfl_key_targets(module_pairs(num_double, num_single, guidance), inner_dim)
    return lambda key: table.get(strip_bfl_prefix(key))


def bfl_to_diffusers(state: dict[str, torch.Tensor], source: str = "BFL checkpoint") -> dict[str, torch.Tensor]:
    """An original-layout Flux transformer state dict (keys optionally under ``model.diffusion_model.``)
    in diffusers' key layout. Unknown or missing keys raise a KeyError naming ``source`` and the key."""
    state = {strip_bfl_prefix(k): v for k, v in state.items()}
    keys = list(state)
    pairs = module_pairs(
        _count(keys, r"double_blocks\.(\d+)\."),
        _count(keys, r"single_blocks\.(\d+)\."),
        any(k.startswith("guidance_in.") for k in keys),
    )
    inner = next((v.shape[1] for k, v in state.items() if re.fullmatch(r"single_blocks\.\d+\.linear1\.weight", k)), 0)
    table = bfl_key_targets(pairs, inner)
    for name in table:
        if name not in state:
            raise KeyError(f"{source}: missing key {name!r}; is this a Flux transformer in the BFL layout?")
    extra = sorted(set(keys) - set(table))
    if extra:
        raise KeyError(f"{source}: {len(extra)} unexpected keys for a Flux transformer, e.g. {extra[:3]}")
    return {
        d_name: transform(state[name]) if transform else state[name]
        for name, targets in table.items()
        for d_name, transform in targets
    }
