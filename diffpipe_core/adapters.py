"""peft adapters (LoRA, LoKr, LoHa: :mod:`diffpipe_core.adapter_kinds`) on the plugin's ``lora_targets``: apply,
collect, export, save and load.

A saved adapter is a folder with ``adapter_model.safetensors`` (diffusers/peft keys under the model's
pipeline prefix, e.g. ``transformer.blocks.0.attn.to_q.lora_A.weight``, with the LoRA config in the
safetensors metadata the way diffusers' ``save_lora_weights`` writes it, so ``load_lora_weights`` applies
the trained alpha), the peft ``adapter_config.json``, and any extra formats the plugin exports
(``adapter_model.<format>.safetensors``; kohya/ComfyUI layouts carry one ``.alpha`` scalar per module,
the only place ComfyUI reads the strength from).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftConfig, inject_adapter_in_model, set_peft_model_state_dict
from safetensors.torch import load_file
from torch import nn

from diffpipe_core.adapter_kinds import config_from_saved, is_adapter_param, saved_config
from diffpipe_core.atomic import atomic_save_safetensors, atomic_write_text

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def lora_config(rank: int, alpha: float, dropout: float, target_modules: list[str]) -> LoraConfig:
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules)


def apply_adapter(model: nn.Module, config: PeftConfig, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Inject the adapter's layers (LoRA, LoKr or LoHa) in place, freeze everything else, and cast the adapter's
    weights to ``dtype``."""
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        inject_adapter_in_model(config, model)
    except ValueError as exc:
        targets = config.target_modules
        raise ValueError(f"adapter target_modules {targets} matched nothing in the model: {exc}") from None
    for name, p in model.named_parameters():
        if is_adapter_param(name):
            p.requires_grad_(True)
            if p.device.type != "meta":
                p.data = p.data.to(dtype)
    return model


apply_lora = apply_adapter  # the name LoRA-only callers know


def excluding(model: nn.Module, config: PeftConfig, patterns: Sequence[str]) -> PeftConfig:
    """``config`` adapting the modules its ``target_modules`` match in ``model`` except those a regex of
    ``patterns`` finds in the full module name (``[adapter] exclude_modules``), named one by one; a pattern that
    takes out nothing raises a ValueError naming it and the modules there were."""
    import copy
    import re

    from peft.tuners.tuners_utils import check_target_module_exists

    if not patterns:
        return config
    matched = [name for name, _ in model.named_modules() if name and check_target_module_exists(config, name)]
    idle = [p for p in patterns if not any(re.search(p, name) for name in matched)]
    if idle:
        shown = ", ".join(matched[:4]) + (f" and {len(matched) - 4} more" if len(matched) > 4 else "")
        raise ValueError(f"adapter.exclude_modules: {idle[0]!r} matches none of the {len(matched)} adapted modules "
                         f"({shown}); remove it or fix the regex")
    kept = [name for name in matched if not any(re.search(p, name) for p in patterns)]
    if not kept:
        raise ValueError(
            f"adapter.exclude_modules: {list(patterns)} take out every adapted module; nothing would train"
        )
    config = copy.deepcopy(config)
    config.target_modules = kept
    return config


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter weights with peft's adapter name removed (``...to_q.lora_A.weight``, ``...to_q.lokr_w1``); meta
    tensors skipped."""
    out = {}
    for name, p in model.named_parameters():
        if is_adapter_param(name) and p.device.type != "meta":
            out[name.replace(".default", "")] = p.detach()
    return out


lora_state_dict = adapter_state_dict


def with_alpha(state: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """Add one scalar ``<module>.alpha`` tensor per LoRA module."""
    out = dict(state)
    for key in state:
        if key.endswith(".lora_A.weight"):
            out[key[: -len(".lora_A.weight")] + ".alpha"] = torch.tensor(float(alpha))
    return out


def diffusers_format(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The default export: peft keys under the diffusers pipeline prefix. No ``.alpha`` tensors: diffusers
    rejects them in a peft-format file and reads alpha from the metadata :func:`save_adapter` writes."""
    return {f"{prefix}.{k}": v for k, v in state.items()}


def kohya_format(
    state: dict[str, torch.Tensor],
    alpha: float,
    prefix: str = "lora_unet",
    rename: Callable[[str], str | None] | None = None,
) -> dict[str, torch.Tensor]:
    """peft keys -> kohya keys, as ComfyUI and A1111 load them.

    ``blocks.0.attn.to_q.lora_A.weight`` becomes ``<prefix>_blocks_0_attn_to_q.lora_down.weight`` (``lora_B`` ->
    ``lora_up``) plus a scalar ``.alpha``. ``rename`` first maps the module path (e.g. diffusers -> original
    SGM/BFL names); returning None drops that module.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        for part, kohya in ((".lora_A.weight", "lora_down"), (".lora_B.weight", "lora_up")):
            if key.endswith(part):
                module = key[: -len(part)]
                module = rename(module) if rename else module
                if module is None:
                    break
                name = f"{prefix}_{module.replace('.', '_')}"
                out[f"{name}.{kohya}.weight"] = value
                out[f"{name}.alpha"] = torch.tensor(float(alpha))
                break
    return out


@dataclass(frozen=True)
class FusedTarget:
    """A module of another key layout (ComfyUI's, an original checkpoint's) whose weight is the weights of
    ``parts`` (module paths of the trained model) stacked along the output dimension, in order.

    ``sizes``: the output rows of each part; needed for a part without a LoRA (its rows are zero in the fused
    ``lora_B``). Empty: every part's rows are read from its own ``lora_B``.
    """

    name: str
    parts: tuple[str, ...]
    sizes: tuple[int, ...] = ()


def fuse_lora(
    state: dict[str, torch.Tensor], target: FusedTarget, alpha: float
) -> dict[str, torch.Tensor] | None:
    """The one LoRA of ``target`` that applies exactly what its parts' peft LoRAs in ``state`` apply.

    ``lora_A`` stacks the adapted parts' ``lora_A`` rows; ``lora_B`` is block-diagonal (zero rows for a part
    without LoRA), so ``lora_B @ lora_A`` is the parts' ``B_i @ A_i`` stacked. Its rank is the sum of the parts'
    ranks, so ``alpha`` is multiplied by the number of adapted parts: tools that scale by alpha / rank (ComfyUI)
    then apply the trained strength. Returns ``{"lora_A.weight", "lora_B.weight", "alpha"}``, or None when no
    part has a LoRA.
    """
    present = [p for p in target.parts if f"{p}.lora_A.weight" in state]
    if not present:
        return None
    downs = [state[f"{p}.lora_A.weight"] for p in present]
    sizes = list(target.sizes)
    if not sizes:
        missing = [p for p in target.parts if p not in present]
        if missing:
            raise ValueError(f"{target.name}: no LoRA on {missing[0]!r} and its size is not given")
        sizes = [state[f"{p}.lora_B.weight"].shape[0] for p in target.parts]
    up = torch.zeros(sum(sizes), sum(d.shape[0] for d in downs), dtype=downs[0].dtype)
    row = col = 0
    for part, size in zip(target.parts, sizes, strict=True):
        if part in present:
            lora_b = state[f"{part}.lora_B.weight"]
            if lora_b.shape[0] != size:
                raise ValueError(f"{part}.lora_B.weight has {lora_b.shape[0]} rows; {target.name} expects {size}")
            up[row : row + size, col : col + lora_b.shape[1]] = lora_b
            col += lora_b.shape[1]
        row += size
    return {"lora_A.weight": torch.cat(downs, dim=0), "lora_B.weight": up, "alpha": torch.tensor(alpha * len(present))}


def fused_lora_format(
    state: dict[str, torch.Tensor], alpha: float, targets: Iterable[FusedTarget], prefix: str
) -> dict[str, torch.Tensor]:
    """peft LoRA keys -> ``<prefix>.<target.name>.lora_A.weight`` / ``.lora_B.weight`` / ``.alpha`` for every
    target with an adapted part (:func:`fuse_lora`; a one-part target is a rename). A LoRA module that no
    target takes raises a ValueError naming it."""
    modules = {k[: -len(".lora_A.weight")] for k in state if k.endswith(".lora_A.weight")}
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for target in targets:
        fused = fuse_lora(state, target, float(alpha))
        if fused is not None:
            out.update({f"{prefix}.{target.name}.{k}": v for k, v in fused.items()})
            done.update(target.parts)
    unknown = sorted(modules - done)
    if unknown:
        raise ValueError(f"LoRA modules with no counterpart in the {prefix!r} layout: {unknown[:3]}")
    return out


def peft_adapter_config(config: LoraConfig) -> dict[str, Any]:
    targets = config.target_modules
    return {
        "peft_type": "LORA",
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": sorted(targets) if isinstance(targets, (set, list)) else targets,
        "bias": "none",
        "init_lora_weights": True,
    }


def saved_adapter_config(config: PeftConfig) -> dict[str, Any]:
    """``adapter_config.json`` of any adapter kind."""
    return peft_adapter_config(config) if isinstance(config, LoraConfig) else saved_config(config)


def diffusers_metadata(config: PeftConfig, prefix: str | Sequence[str]) -> dict[str, str]:
    """safetensors metadata as diffusers' ``save_lora_weights`` writes it: the adapter config, keys prefixed, once per
    pipeline component the file adapts (``unet``, ``text_encoder``, ...; diffusers' ``load_lora_adapter`` builds its
    ``LoraConfig`` or ``LoKrConfig`` from it)."""
    prefixes = [prefix] if isinstance(prefix, str) else list(prefix)
    packed = {f"{p}.{k}": v for p in prefixes for k, v in saved_adapter_config(config).items()}
    return {"format": "pt", "lora_adapter_metadata": json.dumps(packed)}


def save_adapter(
    out_dir: Path,
    files: dict[str, dict[str, torch.Tensor]],
    config: PeftConfig,
    dtype: torch.dtype,
    prefix: str,
    metadata: dict[str, str] | None = None,
    config_labels: dict[str, str] | None = None,
) -> None:
    """Write each ``{filename: state_dict}`` atomically in ``dtype`` plus ``adapter_config.json``; every file's
    metadata also holds ``metadata``, and ``adapter_config.json`` ``config_labels`` (e.g. which network of the model
    the adapter is for).

    Only the diffusers file (``adapter_model.safetensors``) carries the adapter config as metadata; diffusers
    refuses kohya-style files that have both ``.alpha`` tensors and that metadata.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    others = sorted({k.split(".", 1)[0] for k in files.get(ADAPTER_FILE, {})} - {prefix})  # e.g. text encoders
    for name, state in files.items():
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
        meta = diffusers_metadata(config, [prefix, *others]) if name == ADAPTER_FILE else {"format": "pt"}
        meta |= metadata or {}
        atomic_save_safetensors(tensors, out_dir / name, meta)
    saved = saved_adapter_config(config) | (config_labels or {})
    atomic_write_text(out_dir / CONFIG_FILE, json.dumps(saved, indent=2))


def read_adapter(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a saved adapter folder (or its safetensors file): ``(state_dict, adapter_config)``."""
    path = Path(path)
    file = path / ADAPTER_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no adapter found (expected a folder holding {ADAPTER_FILE})")
    cfg_file = file.parent / CONFIG_FILE
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: adapter config missing beside {file.name}")
    return load_file(str(file)), json.loads(cfg_file.read_text())


def load_adapter(model: nn.Module, path: Path, prefix: str | None = None) -> nn.Module:
    """Inject the saved adapter (any kind) into a fresh ``model`` (the bare diffusion model) and load its weights.

    ``prefix`` is the pipeline prefix the keys were saved under (``"transformer"``); detected when None.
    """
    state, cfg = read_adapter(path)
    if prefix is None:
        prefix = next(iter(state)).split(".", 1)[0]
    bare = {
        k[len(prefix) + 1 :]: v for k, v in state.items() if k.startswith(prefix + ".") and not k.endswith(".alpha")
    }
    apply_adapter(model, config_from_saved({"lora_dropout": 0.0, **cfg}))
    result = set_peft_model_state_dict(model, bare)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"{path}: {len(unexpected)} adapter keys do not match the model, e.g. {unexpected[:3]}")
    return model
