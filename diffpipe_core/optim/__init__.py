"""Optimizers by name (built-ins plus those plugins register) and the LR schedule."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from diffpipe_core.config import OptimizerConfig
from diffpipe_core.types import ParameterGroup

OptimizerFactory = Callable[..., torch.optim.Optimizer]


def _adamw8bit(params: Iterable[torch.nn.Parameter], **kw: Any) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, **kw)


def _adamw8bit_kahan(params: Iterable[torch.nn.Parameter], **kw: Any) -> torch.optim.Optimizer:
    from diffpipe_core.optim.kahan import AdamW8bitKahan

    return AdamW8bitKahan(params, **kw)


def builtin_optimizers() -> dict[str, OptimizerFactory]:
    return {
        "adamw": lambda params, **kw: torch.optim.AdamW(params, **kw),
        "adamw8bit": _adamw8bit,
        "adamw8bit_kahan": _adamw8bit_kahan,
        "sgd": lambda params, lr, weight_decay, **_: torch.optim.SGD(params, lr=lr, weight_decay=weight_decay),
    }


def available_optimizers(pm: Any) -> dict[str, OptimizerFactory]:
    """Built-ins plus every ``register_optimizers`` contribution."""
    table = builtin_optimizers()
    pm.hook.register_optimizers(register=lambda name, factory: table.__setitem__(name, factory))
    return table


def build_optimizer(
    cfg: OptimizerConfig, params: list[torch.nn.Parameter] | list[dict[str, Any]], pm: Any
) -> torch.optim.Optimizer:
    """The ``[optimizer]`` over ``params``: parameters, or torch parameter groups (:func:`parameter_groups`)."""
    table = available_optimizers(pm)
    if cfg.type not in table:
        raise ValueError(f"optimizer.type: unknown optimizer {cfg.type!r}; available: {', '.join(sorted(table))}")
    flat = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else params
    _warn_low_precision_adamw(cfg.type, flat)  # type: ignore[arg-type]
    return table[cfg.type](params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=cfg.eps)


def parameter_groups(
    named: dict[str, torch.nn.Parameter], groups: list[ParameterGroup] | None
) -> list[torch.nn.Parameter] | list[dict[str, Any]]:
    """``named`` (trainable parameters by name) as torch parameter groups, one per plugin-named group that holds any
    of them (``{"params", "name"[, "lr"]}``, in the plugin's order, the rest last as ``"default"``); the plain list
    when the plugin names none."""
    if not groups:
        return list(named.values())
    members: dict[str, list[torch.nn.Parameter]] = {g.name: [] for g in [*groups, ParameterGroup("default", ())]}
    for name, p in named.items():
        group = next((g.name for g in groups if name.startswith(g.prefixes)), "default")
        members[group].append(p)
    lrs = {g.name: g.lr for g in groups}
    return [
        {"params": ps, "name": name, **({"lr": lrs[name]} if lrs.get(name) is not None else {})}
        for name, ps in members.items()
        if ps
    ]


LOW_PRECISION = (torch.bfloat16, torch.float16)


def _warn_low_precision_adamw(name: str, params: list[torch.nn.Parameter]) -> None:
    """Plain AdamW on bf16/fp16 weights (a full fine-tune of a bf16 model) rounds away every update below the
    weights' resolution; say so once, on rank 0, and name the optimizer that keeps them."""
    if name not in ("adamw", "adamw8bit") or not any(p.dtype in LOW_PRECISION for p in params):
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    dtype = next(p.dtype for p in params if p.dtype in LOW_PRECISION)
    print(
        f"diffpipe: warning: optimizer {name!r} updates {str(dtype).removeprefix('torch.')} weights in place, so "
        "updates smaller than the weights' resolution (about |w|/256 in bf16) are lost and training can stall; "
        "use [optimizer] type = 'adamw8bit_kahan' (Kahan-compensated updates) for a low-precision full fine-tune",
        flush=True,
    )


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based): linear warmup, then the schedule."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
