"""Optimizer names, without importing torch: what ``validate`` checks ``[optimizer] type`` against."""

from __future__ import annotations

from typing import Any

BUILTIN_OPTIMIZERS = ("adamw", "adamw8bit", "adamw8bit_kahan", "sgd")
# whose update of one parameter reads only that parameter's state: [optimizer] offload steps them one at a time
# (not optimi's: their step counter is the group's, so stepping one parameter at a time would count it once each)
OFFLOADABLE_OPTIMIZERS = (*BUILTIN_OPTIMIZERS, "automagic", "muon")
# elementwise optimizers whose state keeps its meaning on DeepSpeed's flat float32 partition ([run] zero_stage = 1)
ZERO_OPTIMIZERS = ("adamw", "sgd")


def optimizer_names(pm: Any) -> list[str]:
    """The built-in optimizers and every name a plugin's ``register_optimizers`` contributes (a family as
    ``prefix.*``)."""
    names = set(BUILTIN_OPTIMIZERS)
    pm.hook.register_optimizers(register=lambda name, factory: names.add(name))
    return sorted(names)


def is_known_optimizer(name: str, names: list[str]) -> bool:
    """``name`` is registered, or is ``prefix.Rest`` of a registered family ``prefix.*`` (whose class the
    optimizer's own check, before any work, looks up)."""
    prefix, dot, rest = name.partition(".")
    return name in names or bool(dot and rest and f"{prefix}.*" in names)
