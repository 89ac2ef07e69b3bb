"""Optimizers by name (built-ins plus those plugins register), parameter groups with their own learning rates,
and the LR schedule."""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
from collections.abc import Callable, Iterable, Iterator
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
        "sgd": lambda params, lr, weight_decay, betas, eps, **kw: torch.optim.SGD(
            params, lr=lr, weight_decay=weight_decay, **kw
        ),
    }
    assert tuple(table) == BUILTIN_OPTIMIZERS  # the names validate checks, kept torch-free in optimizer_names
    return table


def available_optimizers(pm: Any) -> dict[str, OptimizerFactory]:
    """Built-ins plus every ``register_optimizers`` contribution (a family, ``"prefix.*"``, maps to its lookup)."""
    table = builtin_optimizers()
    pm.hook.register_optimizers(register=lambda name, factory: table.__setitem__(name, factory))
    return table


def find_optimizer(table: dict[str, OptimizerFactory], name: str) -> tuple[OptimizerFactory, bool]:
    """``(factory, from_family)`` for ``[optimizer] type = name``: a registered name, or ``prefix.Rest`` of a
    registered family ``prefix.*`` (whose lookup is called with ``Rest`` and raises a ValueError naming the valid
    ones). A ValueError naming the available ones when neither."""
    if name in table:
        return table[name], False
    prefix, dot, rest = name.partition(".")
    if dot and rest and f"{prefix}.*" in table:
        return table[f"{prefix}.*"](rest), True
    raise ValueError(f"optimizer.type: unknown optimizer {name!r}; available: {', '.join(sorted(table))}")


DEFAULT_GROUP = "model"  # the one parameter group of a plugin that names none


def parameter_groups(
    cfg: OptimizerConfig, trainable: dict[str, torch.nn.Parameter], named: dict[str, list[str]] | None
) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: ``{"name", "params", "lr"}`` per group the plugin names (its
    ``parameter_groups`` hook: group -> regexes matched against parameter names; a parameter matching none joins
    the first group), each at ``cfg.group_lr[name]`` or ``cfg.lr``, and one group per name pattern of ``group_lr``
    (:func:`~diffpipe_core.config.is_lr_pattern`: a glob such as ``*.attn*``), named by the pattern, holding the
    parameters it is the first pattern to match. Groups with no parameter on this pipeline stage are left out.
    Without ``cfg.group_lr`` all parameters form one group, as before groups existed."""
    from diffpipe_core.config import is_lr_pattern

    if not cfg.group_lr:
        return [{"name": DEFAULT_GROUP, "params": list(trainable.values()), "lr": cfg.lr}]
    globs = [key for key in cfg.group_lr if is_lr_pattern(key)]
    members = _members(trainable, named or {DEFAULT_GROUP: []}, globs)
    return [{"name": g, "params": ps, "lr": cfg.group_lr.get(g, cfg.lr)} for g, ps in members.items() if ps]


def plugin_groups(
    trainable: dict[str, torch.nn.Parameter], named: dict[str, list[str]] | None
) -> list[list[torch.nn.Parameter]]:
    """The trainable parameters of each group the plugin names (its ``parameter_groups`` hook), with or without
    ``group_lr``: the networks a step may leave out (Wan 2.2 A14B's two experts), though they share one optimizer
    group at one learning rate. Empty without named groups."""
    if not named:
        return []
    return [ps for ps in _members(trainable, named, []).values() if ps]


def _members(
    trainable: dict[str, torch.nn.Parameter], named: dict[str, list[str]], globs: list[str]
) -> dict[str, list[torch.nn.Parameter]]:
    """Each parameter in the group of the first glob of ``globs`` it matches, else of the first named group a
    pattern of which matches it, else of the first named group."""
    patterns = {g: [re.compile(p) for p in pats] for g, pats in named.items()}
    members: dict[str, list[torch.nn.Parameter]] = {g: [] for g in [*named, *globs]}
    first = next(iter(named))
    for name, param in trainable.items():
        group = next((g for g in globs if fnmatch.fnmatchcase(name, g)), None)
        if group is None:
            group = next((g for g, pats in patterns.items() if any(p.match(name) for p in pats)), first)
        members[group].append(param)
    return members


def freeze_zero_lr_groups(
    model: torch.nn.Module, cfg: OptimizerConfig, named: dict[str, list[str]] | None
) -> list[str]:
    """Freeze the trainable parameters of every group :func:`parameter_groups` puts at learning rate 0 (``group_lr``
    of 0, e.g. Anima's LLM adapter by default): they stop requiring gradients, so they get no gradient, no optimizer
    state and no share of the clipping norm, and stay as loaded. Returns their names."""
    if not any(v == 0 for v in cfg.group_lr.values()):
        return []
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {id(p) for g in parameter_groups(cfg, trainable, named) if g["lr"] == 0 for p in g["params"]}
    names = [n for n, p in trainable.items() if id(p) in frozen]
    for name in names:
        trainable[name].requires_grad_(False)
    return names


def unmatched_lr_patterns(group_lr: dict[str, float], names: Iterable[str]) -> list[str]:
    """The name patterns of ``group_lr`` that match none of the trainable parameter ``names``."""
    from diffpipe_core.config import is_lr_pattern

    names = list(names)
    return [g for g in group_lr if is_lr_pattern(g) and not any(fnmatch.fnmatchcase(n, g) for n in names)]


def build_optimizer(
    cfg: OptimizerConfig, groups: list[Any], pm: Any, lora: bool = False, zero: bool = False
) -> torch.optim.Optimizer:
    """The optimizer ``cfg.type`` names over ``groups`` (:func:`parameter_groups`; or a plain list of parameters:
    one group at ``cfg.lr``). One group is passed as a plain parameter list, so its state is laid out as before
    groups existed. ``lora``: the parameters are an adapter's; ``zero``: DeepSpeed's ZeRO will hand it a float32
    copy of them instead (both for the low-precision warning)."""
    if groups and not isinstance(groups[0], dict):
        groups = [{"name": DEFAULT_GROUP, "params": list(groups), "lr": cfg.lr}]
    factory, from_family = find_optimizer(available_optimizers(pm), cfg.type)
    params = [p for g in groups for p in g["params"]]
    _warn_low_precision_adamw(cfg.type, params, lora, zero)
    lr = groups[0]["lr"] if len(groups) == 1 else cfg.lr
    given: Any = params if len(groups) == 1 else groups
    try:
        return factory(given, **_base_kwargs(cfg, lr, from_family))
    except TypeError as exc:
        if not cfg.kwargs:
            raise
        raise ValueError(f"optimizer.kwargs: {cfg.type!r} does not take {sorted(cfg.kwargs)}: {exc}") from None


def _base_kwargs(cfg: OptimizerConfig, lr: float, set_only: bool = False) -> dict[str, Any]:
    """The optimizer's keyword arguments; ``set_only`` (a family's class, whose own defaults may differ in kind, as
    a third beta): betas, weight_decay and eps only where the config sets them."""
    base = {"betas": cfg.betas, "weight_decay": cfg.weight_decay, "eps": cfg.eps}
    if set_only:
        base = {k: v for k, v in base.items() if k in cfg.model_fields_set}
    return {"lr": lr, **base, **cfg.kwargs}


def kwargs_problems(cfg: OptimizerConfig, pm: Any, source: str) -> list[str]:
    """``[optimizer] kwargs`` the optimizer does not take, or of another type than its default: read from the
    signature of its class (built once over a tiny parameter without them), then built with them, before any work.
    Also what the optimizer refuses without them, when its error names the config key (a family's class it does not
    have, a learning rate it refuses)."""
    try:
        factory, from_family = find_optimizer(available_optimizers(pm), cfg.type)
    except ValueError as exc:  # a family's class it does not have (an unknown name is validate's to report)
        return [f"{source}: {exc}"] if "." in cfg.type else []
    import inspect

    from diffpipe_core.quiet import library_prints

    def build(kwargs: dict[str, Any]) -> torch.optim.Optimizer:
        with library_prints():
            return factory([torch.nn.Parameter(torch.zeros(4))], **kwargs)

    try:
        plain = build(_base_kwargs(cfg.model_copy(update={"kwargs": {}}), cfg.lr, from_family))
    except Exception as exc:  # fails without the kwargs too: theirs to report only when it names a config key
        return [f"{source}: {exc}"] if isinstance(exc, ValueError) and str(exc).startswith("optimizer") else []
    if not cfg.kwargs:
        return []
    params = inspect.signature(type(plain).__init__).parameters
    takes = [n for n, p in params.items() if n not in ("self", "params") and p.kind == p.POSITIONAL_OR_KEYWORD]
    problems = []
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(k for k in cfg.kwargs if k not in params)
        if unknown:
            problems.append(f"{source}: optimizer.kwargs: {cfg.type!r} does not take {unknown}; it takes: "
                            f"{', '.join(takes)}")
    for key, value in cfg.kwargs.items():
        if key in params and (wrong := _wrong_kind(value, params[key].default)):
            problems.append(f"{source}: optimizer.kwargs.{key}: invalid value {value!r}: {wrong}")
    if not problems:
        try:
            build(_base_kwargs(cfg, cfg.lr, from_family))
        except Exception as exc:  # a value the optimizer checks itself (a negative beta, ...)
            problems.append(f"{source}: optimizer.kwargs: {cfg.type!r} refuses {cfg.kwargs}: {exc}")
    return problems


def _wrong_kind(value: Any, default: Any) -> str | None:
    """Why ``value`` cannot stand where a parameter defaults to ``default``, or None."""
    if isinstance(default, bool):
        return None if isinstance(value, bool) else f"true or false is expected (default {default})"
    if isinstance(default, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            kind = "a string" if isinstance(value, str) else type(value).__name__
            return f"{kind}, where a number is expected (default {default!r})"
    if isinstance(default, tuple) and not isinstance(value, (list, tuple)):
        return f"a list is expected (default {list(default)})"
    return None


@contextlib.contextmanager
def evaluation_weights(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside the block the parameters hold the weights to evaluate and save: schedule-free optimizers keep the
    training point in the parameters and switch to the averaged weights with ``eval()`` (and back with
    ``train()``); any optimizer with both methods is treated so. Others: nothing changes."""
    switch = callable(getattr(optimizer, "eval", None)) and callable(getattr(optimizer, "train", None))
    if switch:
        optimizer.eval()  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if switch:
            optimizer.train()  # type: ignore[attr-defined]


LOW_PRECISION = (torch.bfloat16, torch.float16)


def _warn_low_precision_adamw(
    name: str, params: list[torch.nn.Parameter], lora: bool = False, zero: bool = False
) -> None:
    """Plain AdamW on bf16/fp16 weights (LoRA weights in ``[adapter] dtype = 'bfloat16'``, or a full fine-tune of a
    bf16 model) rounds away every update below the weights' resolution; say so once, on rank 0, with the fix. Under
    ZeRO (``zero``) it steps DeepSpeed's float32 copy of the weights instead, which keeps such updates: say that."""
    if name not in ("adamw", "adamw8bit") or not any(p.dtype in LOW_PRECISION for p in params):
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    dtype = str(next(p.dtype for p in params if p.dtype in LOW_PRECISION)).removeprefix("torch.")
    if zero:
        print(
            f"diffpipe: note: zero_stage = 1: optimizer {name!r} steps a float32 copy of this replica's share of the "
            f"{dtype} weights, so updates smaller than the weights' resolution add up there instead of being lost; "
            f"the {dtype} weights are rounded from the copy after each step",
            flush=True,
        )
        return
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


def forced_lr(cfg: OptimizerConfig, lr: float) -> float:
    """The peak learning rate of a group configured at ``lr``: ``force_constant_lr`` when set (a group frozen at 0
    stays frozen)."""
    return lr if cfg.force_constant_lr is None or lr == 0 else cfg.force_constant_lr


def run_lr_lambda(run: Any, total_steps: int) -> Callable[[int], float]:
    """The run's LR multiplier by step: ``[optimizer] force_constant_lr`` sets warmup and schedule aside."""
    if run.optimizer.force_constant_lr is not None:
        return lr_lambda("constant", 0, total_steps)
    return lr_lambda(run.lr_scheduler, run.warmup_steps, total_steps)


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
