"""The ``register_optimizers`` implementation: ``prodigy`` (prodigyopt) and ``adamw_schedulefree`` (schedulefree).

Imported by every ``diffpipe`` command (entry point ``diffpipe.plugins``), so the optimizer packages are imported
only when a run builds its optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl

if TYPE_CHECKING:
    import torch


def _groups(params: Any) -> list[dict[str, Any]]:
    params = list(params)
    return params if params and isinstance(params[0], dict) else [{"params": params}]


def prodigy(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """Prodigy over ``params``. Groups may differ only by a learning rate of 0 (Prodigy's own rule, checked here
    so the error names the config key). On GPUs with several processes its step-size estimate is summed over
    all ranks, which makes a pipeline-parallel run's estimate that of one process."""
    import torch
    import torch.distributed as dist
    from prodigyopt import Prodigy

    from diffpipe_core.quiet import library_prints

    groups = _groups(params)
    lrs = {g.get("lr", kwargs.get("lr", 1.0)) for g in groups} - {0.0}
    if len(lrs) > 1:
        raise ValueError(
            f"optimizer.group_lr: 'prodigy' takes one learning rate for all groups (or 0 to freeze one), got "
            f"{sorted(lrs)}"
        )
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    kwargs.setdefault("fsdp_in_use", distributed and torch.cuda.is_available())  # its all-reduce is CUDA-only
    with library_prints():  # "Using decoupled weight decay"
        return Prodigy(params, **kwargs)


def adamw_schedulefree(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """Schedule-free AdamW, put in training mode; the core switches it to its averaged weights (``eval()``) for
    saves, eval losses and samples (:func:`diffpipe_core.optim.evaluation_weights`)."""
    from schedulefree import AdamWScheduleFree

    optimizer = AdamWScheduleFree(params, **kwargs)
    optimizer.train()
    return optimizer


@hookimpl
def register_optimizers(register: Callable[[str, Callable[..., Any]], None]) -> None:
    """``prodigy`` and ``adamw_schedulefree``."""
    register("prodigy", prodigy)
    register("adamw_schedulefree", adamw_schedulefree)
