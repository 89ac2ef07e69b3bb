"""Optimizers by name (built-ins plus those plugins register) and the LR schedule."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from diffpipe_core.config import OptimizerConfig
from diffpipe_core.optimizer_names import BUILTIN_OPTIMIZERS

OptimizerFactory = Callable[..., torch.optim.Optimizer]


def _adamw8bit(params: Iterable[torch.nn.Parameter], **kw: Any) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, **kw)


def _adamw8bit_kahan(params: Iterable[torch.nn.Parameter], **kw: Any) -> torch.optim.Optimizer:
    from diffpipe_core.optim.kahan import AdamW8bitKahan

    return AdamW8bitKahan(params, **kw)


def builtin_optimizers() -> dict[str, OptimizerFactory]:
    table: dict[str, OptimizerFactory] = {
        "adamw": lambda params, **kw: torch.optim.AdamW(params, **kw),
        "adamw8bit": _adamw8bit,
        "adamw8bit_kahan": _adamw8bit_kahan,
        "sgd": lambda params, lr, weight_decay, **_: torch.optim.SGD(params, lr=lr, weight_decay=weight_decay),
    }
    assert tuple(table) == BUILTIN_OPTIMIZERS  # the names validate checks, kept torch-free in optimizer_names
    return table


def available_optimizers(pm: Any) -> dict[str, OptimizerFactory]:
    """Built-ins plus every ``register_optimizers`` contribution."""
    table = builtin_optimizers()
    pm.hook.register_optimizers(register=lambda name, factory: table.__setitem__(name, factory))
    return table


def build_optimizer(
    cfg: OptimizerConfig, params: list[torch.nn.Parameter], pm: Any, lora: bool = False
) -> torch.optim.Optimizer:
    """The configured optimizer over ``params`` (``lora``: they are an adapter's, for the low-precision warning)."""
    table = available_optimizers(pm)
    if cfg.type not in table:
        raise ValueError(f"optimizer.type: unknown optimizer {cfg.type!r}; available: {', '.join(sorted(table))}")
    _warn_low_precision_adamw(cfg.type, params, lora)
    return table[cfg.type](params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=cfg.eps)


LOW_PRECISION = (torch.bfloat16, torch.float16)


def _warn_low_precision_adamw(name: str, params: list[torch.nn.Parameter], lora: bool = False) -> None:
    """Plain AdamW on bf16/fp16 weights (LoRA weights in ``[adapter] dtype = 'bfloat16'``, or a full fine-tune of a
    bf16 model) rounds away every update below the weights' resolution; say so once, on rank 0, with the fix."""
    if name not in ("adamw", "adamw8bit") or not any(p.dtype in LOW_PRECISION for p in params):
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    dtype = str(next(p.dtype for p in params if p.dtype in LOW_PRECISION)).removeprefix("torch.")
    if lora:
        what = f"the {dtype} LoRA weights ([adapter] dtype = {dtype!r})"
        fix = ("leave [adapter] dtype out (its default 'float32' costs little memory: LoRA weights are small), or "
               "use [optimizer] type = 'adamw8bit_kahan'")
    else:
        what = f"{dtype} weights (a full fine-tune of a {dtype} model)"
        fix = "use [optimizer] type = 'adamw8bit_kahan' (Kahan-compensated updates) for a low-precision full fine-tune"
    print(
        f"diffpipe: warning: optimizer {name!r} updates {what} in place, so updates smaller than the weights' "
        f"resolution (about |w|/256 in bf16) are lost and training can stall; {fix}",
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
