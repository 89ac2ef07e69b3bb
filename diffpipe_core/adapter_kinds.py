"""The adapter kinds of ``[adapter] type``: LoRA, LoKr and LoHa, all peft tuners on the plugin's ``lora_targets``.

This module says which peft config each kind makes, which parameters are the adapter's, what the saved
``adapter_config.json`` holds, and how a LoKr or LoHa is written in the key layout ComfyUI, LyCORIS and kohya's
tools load (LoRA's own formats stay in :mod:`diffpipe_core.adapters` and the plugins' ``export_adapter``).

peft names the trained tensors as LyCORIS does, so a module's tensors keep their names in every layout; only the
module's key stem changes (``transformer.transformer_blocks.0.attn.to_q``, ``lora_unet_input_blocks_4_1_...``):

- LoKr: ``<stem>.lokr_w1`` (or ``.lokr_w1_a`` / ``.lokr_w1_b``), ``<stem>.lokr_w2`` (or ``.lokr_w2_a`` /
  ``.lokr_w2_b``, plus ``.lokr_t2`` for a Tucker conv), and ``<stem>.alpha``;
- LoHa: ``<stem>.hada_w1_a``, ``.hada_w1_b``, ``.hada_w2_a``, ``.hada_w2_b`` (plus ``.hada_t1`` / ``.hada_t2``),
  and ``<stem>.alpha``.

ComfyUI applies (``comfy/weight_adapter/lokr.py``, ``loha.py``) ``dW = kron(w1, w2) * alpha / dim`` for LoKr,
where ``dim`` is the rank of the decomposed factor (``w2_b.shape[0]``, else ``w1_b.shape[0]``) and the scale is 1
when neither factor is decomposed; and ``dW = (w1_a @ w1_b) * (w2_a @ w2_b) * alpha / w1_b.shape[0]`` for LoHa.
peft scales both by ``alpha / r`` always. Every saved file has that scale folded into one factor of each module and
alpha = rank (:func:`fold_strength`), so each tool applies the trained strength whether it reads the alpha or not;
the diffusers file keeps peft's tensor names with the peft config in its metadata, the way diffusers'
``load_lora_adapter`` reads a LoKr.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoHaConfig, LoKrConfig, LoraConfig, PeftConfig


@dataclass(frozen=True)
class AdapterKind:
    """One ``[adapter] type``: its peft type and the names of its trained tensors."""

    name: str
    peft_type: str
    tensors: tuple[str, ...]


KINDS = {
    "lora": AdapterKind("lora", "LORA", ("lora_A", "lora_B")),
    "lokr": AdapterKind(
        "lokr", "LOKR", ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
    ),
    "loha": AdapterKind("loha", "LOHA", ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")),
}
MARKERS = ("lora_", "lokr_", "hada_")  # a parameter path component starting with one is an adapter tensor


def is_adapter_param(name: str) -> bool:
    """Whether ``name`` (a ``named_parameters`` or saved key) is an adapter tensor of any kind."""
    return any(part.startswith(MARKERS) for part in name.split("."))


def kind_of(config: PeftConfig) -> AdapterKind:
    if isinstance(config, LoKrConfig):
        return KINDS["lokr"]
    if isinstance(config, LoHaConfig):
        return KINDS["loha"]
    return KINDS["lora"]


def alpha_and_rank(config: PeftConfig) -> tuple[float, int]:
    if isinstance(config, LoraConfig):
        return float(config.lora_alpha), int(config.r)
    return float(config.alpha), int(config.r)  # type: ignore[attr-defined]


def peft_config(
    kind: str,
    rank: int,
    alpha: float,
    target_modules: list[str],
    *,
    dropout: float = 0.0,
    factor: int = -1,
    decompose_both: bool = False,
    rank_dropout: float = 0.0,
    module_dropout: float = 0.0,
) -> PeftConfig:
    """The peft config of one ``[adapter]`` table."""
    if kind == "lora":
        return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules)
    common = {"r": rank, "alpha": alpha, "target_modules": target_modules}
    common |= {"rank_dropout": rank_dropout, "module_dropout": module_dropout}
    if kind == "lokr":
        return LoKrConfig(**common, decompose_factor=factor, decompose_both=decompose_both)
    if kind == "loha":
        return LoHaConfig(**common)
    raise ValueError(f"adapter.type: unknown adapter kind {kind!r}; valid: {', '.join(KINDS)}")


def from_adapter_table(adapter: Any, target_modules: list[str]) -> PeftConfig:
    """The peft config of a validated ``[adapter]`` table (:class:`diffpipe_core.config.AdapterConfig`)."""
    return peft_config(
        adapter.type,
        adapter.rank,
        adapter.effective_alpha,
        target_modules,
        dropout=adapter.dropout,
        factor=adapter.factor,
        decompose_both=adapter.decompose_both,
        rank_dropout=adapter.rank_dropout,
        module_dropout=adapter.module_dropout,
    )


def _targets(config: PeftConfig) -> Any:
    targets = config.target_modules
    return sorted(targets) if isinstance(targets, (set, list)) else targets


STRENGTH_TENSORS = ("lora_B", "lokr_w1", "lokr_w1_a", "hada_w1_a")  # one per module: the factor the scale goes into


def _strength_tensor(key: str) -> bool:
    return any(part in STRENGTH_TENSORS for part in key.split("."))


def with_strength(config: PeftConfig, alpha: float) -> PeftConfig:
    """``config`` with its alpha set to ``alpha`` (the rest unchanged)."""
    import copy

    out = copy.deepcopy(config)
    if isinstance(out, LoraConfig):
        out.lora_alpha = alpha
    else:
        out.alpha = alpha  # type: ignore[attr-defined]
    return out


def fold_strength(state: dict[str, torch.Tensor], config: PeftConfig) -> tuple[dict[str, torch.Tensor], PeftConfig]:
    """The adapter with peft's ``alpha / r`` multiplied into one factor of every module (``lora_B``, ``lokr_w1`` or
    ``lokr_w1_a``, ``hada_w1_a``) and alpha set to the rank.

    Every tool then applies the trained strength whatever it reads: diffusers with or without the file's metadata
    (its default alpha is the rank), ComfyUI with or without an ``.alpha`` key (none: scale 1), kohya's tools."""
    alpha, rank = alpha_and_rank(config)
    if alpha == rank:
        return state, config
    scale = alpha / rank
    wide = {k: v if v.dtype == torch.float64 else v.float() for k, v in state.items()}  # saving casts once, after
    folded = {k: v * scale if _strength_tensor(k) else v for k, v in wide.items()}
    return folded, with_strength(config, float(rank))


def unfold_factor(saved: PeftConfig, run: PeftConfig) -> float:
    """What a saved adapter's strength tensors are multiplied by to train on under ``run``'s alpha and rank: 1 when
    both scale alike (a file with alpha folded in has scale 1; an older one kept its own alpha)."""
    (saved_alpha, saved_rank), (run_alpha, run_rank) = alpha_and_rank(saved), alpha_and_rank(run)
    return (saved_alpha / saved_rank) / (run_alpha / run_rank)


def saved_config(config: PeftConfig) -> dict[str, Any]:
    """``adapter_config.json`` (and the diffusers file's metadata) of a LoKr or LoHa: peft config fields only, so
    ``LoKrConfig(**it)`` (what diffusers' ``load_lora_adapter`` does with the metadata) rebuilds the config."""
    out: dict[str, Any] = {"peft_type": kind_of(config).peft_type, "r": config.r, "alpha": config.alpha}
    out |= {"rank_dropout": config.rank_dropout, "module_dropout": config.module_dropout}
    if isinstance(config, LoKrConfig):
        out |= {"decompose_factor": config.decompose_factor, "decompose_both": config.decompose_both}
    return out | {"target_modules": _targets(config), "init_weights": True}


def config_from_saved(saved: dict[str, Any]) -> PeftConfig:
    """The peft config of a saved ``adapter_config.json`` (any kind)."""
    kind = next((k for k in KINDS.values() if k.peft_type == saved.get("peft_type", "LORA")), None)
    if kind is None:
        raise ValueError(f"adapter_config.json: peft_type {saved.get('peft_type')!r} is not LORA, LOKR or LOHA")
    targets = saved["target_modules"]
    if kind.name == "lora":
        alpha = float(saved.get("lora_alpha") or saved["r"])
        return peft_config("lora", int(saved["r"]), alpha, targets, dropout=float(saved.get("lora_dropout", 0.0)))
    return peft_config(
        kind.name,
        int(saved["r"]),
        float(saved.get("alpha") or saved["r"]),
        targets,
        factor=int(saved.get("decompose_factor", -1)),
        decompose_both=bool(saved.get("decompose_both", False)),
        rank_dropout=float(saved.get("rank_dropout", 0.0)),
        module_dropout=float(saved.get("module_dropout", 0.0)),
    )


def adapter_table(saved: dict[str, Any], path: Path) -> dict[str, Any]:
    """An ``[adapter]`` table (as a dict) that rebuilds a saved adapter and starts from its weights."""
    config = config_from_saved(saved)
    kind = kind_of(config)
    alpha, rank = alpha_and_rank(config)
    targets = _targets(config)
    table: dict[str, Any] = {"type": kind.name, "rank": rank, "alpha": alpha, "init_from_existing": Path(path)}
    table["target_modules"] = [targets] if isinstance(targets, str) else targets or None
    if isinstance(config, LoKrConfig):
        table |= {"factor": config.decompose_factor, "decompose_both": config.decompose_both}
    return table


def split_key(key: str, kind: AdapterKind) -> tuple[str, str] | None:
    """``("blocks.0.to_q", "lokr_w1")`` for ``"blocks.0.to_q.lokr_w1"``; None when it is no tensor of ``kind``."""
    module, _, tensor = key.rpartition(".")
    return (module, tensor) if tensor in kind.tensors and module else None


def modules_of(state: dict[str, torch.Tensor], kind: AdapterKind) -> list[str]:
    """The adapted modules of a LoKr/LoHa state dict, sorted."""
    found = {parts[0] for key in state if (parts := split_key(key, kind))}
    unknown = [k for k in state if split_key(k, kind) is None]
    if unknown:
        raise ValueError(f"{kind.name} adapter tensors with unknown names: {unknown[:3]}")
    return sorted(found)


def comfy_tensors(state: dict[str, torch.Tensor], config: PeftConfig) -> dict[str, dict[str, torch.Tensor]]:
    """Each module's tensors as ComfyUI's formula reads them (module docstring), plus its ``alpha``.

    ``state`` has peft's keys without the adapter name (``blocks.0.to_q.lokr_w1``). The result applies exactly
    peft's ``alpha / r`` scaling under ComfyUI's ``alpha / dim`` reading.
    """
    kind = kind_of(config)
    alpha, rank = alpha_and_rank(config)
    out: dict[str, dict[str, torch.Tensor]] = {m: {} for m in modules_of(state, kind)}
    for key, value in state.items():
        module, tensor = split_key(key, kind)  # type: ignore[misc]
        out[module][tensor] = value
    for tensors in out.values():
        if kind.name == "lokr" and "lokr_w1" in tensors and "lokr_w2" in tensors:
            # ComfyUI ignores alpha when neither factor is decomposed: fold peft's alpha / r in
            tensors["lokr_w1"] = tensors["lokr_w1"] * (alpha / rank)
            tensors["alpha"] = torch.tensor(float(rank))
        else:
            tensors["alpha"] = torch.tensor(alpha)
    return out


def keyed_format(
    state: dict[str, torch.Tensor], config: PeftConfig, stems: dict[str, str]
) -> dict[str, torch.Tensor]:
    """A LoKr/LoHa in a ComfyUI/LyCORIS layout: ``<stems[module]>.<tensor>`` and ``<stems[module]>.alpha``.

    ``stems`` maps each adapted module (diffusion-model path) to its key stem in the layout; a module it leaves
    out raises a ValueError naming it."""
    tensors = comfy_tensors(state, config)
    missing = sorted(set(tensors) - set(stems))
    if missing:
        raise ValueError(f"no key in this layout for the adapted modules {missing[:3]}")
    return {f"{stems[m]}.{name}": value for m, named in tensors.items() for name, value in named.items()}
