"""The ``register_optimizers`` implementation: ``prodigy`` (prodigyopt), ``adamw_schedulefree`` (schedulefree),
``adamw_optimi`` and ``stableadamw`` (torch-optimi), ``automagic``, ``muon`` (torch's Muon with AdamW) and every
optimizer class of pytorch-optimizer as ``pytorch_optimizer.<Class>``.

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


def _need(module: str, package: str, name: str) -> Any:
    """Import ``module``, or one line saying which pip command gives the optimizer ``name``."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(
            f"optimizer.type: {name!r} needs the {package} package, which is not installed: pip install {package}"
        ) from None


def adamw_optimi(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """optimi's AdamW: Kahan summation for bf16/fp16 parameters, on by itself (the anchor's default optimizer)."""
    return _need("optimi", "torch-optimi", "adamw_optimi").AdamW(params, **kwargs)


def stableadamw(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """optimi's StableAdamW (AdamW with AdaFactor's update clipping), Kahan summation for bf16/fp16 parameters."""
    return _need("optimi", "torch-optimi", "stableadamw").StableAdamW(params, **kwargs)


def automagic(params: Any, lr: float, betas: Any = None, eps: Any = None, **kwargs: Any) -> torch.optim.Optimizer:
    """Automagic (:mod:`diffpipe_optimizers.automagic`): ``lr`` is each element's starting rate. It has no betas
    (``beta2`` goes in kwargs) and its ``eps`` is added to squared gradients, so [optimizer] betas and eps, meant for
    Adam, are not passed."""
    from diffpipe_optimizers.automagic import Automagic

    return Automagic(params, lr=lr, **kwargs)


def muon(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """torch.optim.Muon for 2-D weights, AdamW for the rest (:mod:`diffpipe_optimizers.muon`)."""
    from diffpipe_optimizers.muon import MuonWithAdamW

    return MuonWithAdamW(params, **kwargs)


def pytorch_optimizer_class(name: str) -> Callable[..., torch.optim.Optimizer]:
    """The factory of pytorch-optimizer's class ``name`` (``[optimizer] type = "pytorch_optimizer.CAME"``); a
    ValueError naming close class names when it has none. The core passes [optimizer] betas, eps and weight_decay only
    when the config sets them (else the class's own defaults hold); one the class does not take is refused."""
    import difflib
    import inspect

    module = _need("pytorch_optimizer", "pytorch-optimizer", f"pytorch_optimizer.{name}")
    import torch

    classes = {n: c for n, c in vars(module).items() if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)}
    if name not in classes:
        close = difflib.get_close_matches(name, classes, n=3, cutoff=0.5)
        hint = (f"did you mean {', '.join(repr(f'pytorch_optimizer.{c}') for c in close)}?" if close
                else f"its classes: {', '.join(sorted(classes))}")
        raise ValueError(f"optimizer.type: pytorch-optimizer has no optimizer class {name!r}; {hint}")
    cls = classes[name]
    takes = inspect.signature(cls.__init__).parameters

    def build(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
        unknown = sorted(k for k in ("betas", "eps", "weight_decay") if k in kwargs and k not in takes)
        if unknown:
            raise ValueError(f"optimizer: pytorch_optimizer.{name} does not take {unknown}; remove them from "
                             f"[optimizer] (it takes: {', '.join(k for k in takes if k not in ('self', 'params'))})")
        default = getattr(takes.get("betas"), "default", None)
        if "betas" in kwargs and isinstance(default, tuple) and len(kwargs["betas"]) != len(default):
            raise ValueError(f"optimizer.betas: pytorch_optimizer.{name} takes {len(default)} betas (its default: "
                             f"{list(default)}), got {list(kwargs['betas'])}")
        return cls(params, **kwargs)

    return build


@hookimpl
def register_optimizers(register: Callable[[str, Callable[..., Any]], None]) -> None:
    """``prodigy``, ``adamw_schedulefree``, ``adamw_optimi``, ``stableadamw``, ``automagic``, ``muon`` and the family
    ``pytorch_optimizer.*``."""
    register("prodigy", prodigy)
    register("adamw_schedulefree", adamw_schedulefree)
    register("adamw_optimi", adamw_optimi)
    register("stableadamw", stableadamw)
    register("automagic", automagic)
    register("muon", muon)
    register("pytorch_optimizer.*", pytorch_optimizer_class)
