"""Forward passes on the meta device (shapes and dtypes, no data, no compute) with integer tensors kept real.

A layer's float tensors (activations, weights) can stay on meta, but some layers read integer values: a
HunyuanVideo final layer un-patches with ``grid.tolist()``, masks are built by comparing index ranges. Under
:class:`MetaWithRealIntegers` integer and bool tensors a layer makes "on meta" are made on the CPU instead, with
their values, and ``.to(meta)`` leaves them there; an op mixing the two sees its CPU tensors moved to meta. So
``grid.tolist()`` gives the real sizes while every float tensor of the model stays shape-only.

Attention (``F.scaled_dot_product_attention``) on meta inputs keeps for backward what the fused kernels a real run
uses keep (flash / memory-efficient on GPUs, flash on CPUs): query, key, value, output, the float32 log-sum-exp per
query and the mask, not the (length x length) probabilities of the math path the meta device would otherwise take.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

META, CPU = torch.device("meta"), torch.device("cpu")
_FACTORIES = {
    torch.tensor, torch.as_tensor, torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.randint,
    torch.eye,
}  # fmt: skip


def is_exact(dtype: torch.dtype | None) -> bool:
    """Integer or bool (not float, not complex)."""
    return dtype is not None and not (dtype.is_floating_point or dtype.is_complex)


def _is_meta(device: Any) -> bool:
    return isinstance(device, str | torch.device) and torch.device(device).type == "meta"


def _factory_dtype(func: Any, args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype a factory call will make (None: the default float dtype)."""
    if kwargs.get("dtype") is not None:
        return kwargs["dtype"]
    if func in (torch.tensor, torch.as_tensor):
        data = args[0] if args else kwargs.get("data")
        return data.dtype if torch.is_tensor(data) else torch.tensor(data).dtype
    if func is torch.arange:
        return torch.int64 if all(isinstance(a, int) for a in args) else None
    if func is torch.full:
        fill = args[1] if len(args) > 1 else kwargs.get("fill_value")
        return torch.tensor(fill).dtype if isinstance(fill, int) else None
    if func is torch.randint:
        return torch.int64
    return None


def _target_device(args: tuple, kwargs: dict) -> torch.device | None:
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, str | torch.device):
            return torch.device(a)
        if torch.is_tensor(a):
            return a.device
    return None


class _FusedAttention(torch.autograd.Function):
    """Shapes of a fused attention kernel's forward, saving what it saves (backward is never run)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if torch.is_tensor(mask) else []))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # pragma: no cover - measurement only
        raise NotImplementedError("meta attention is for measuring forward memory only")


def _attention(args: tuple, kwargs: dict) -> torch.Tensor:
    q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")][len(args):])[:3]
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    mask = _to_meta(mask)
    return _FusedAttention.apply(q, k, v, mask)


def _to_meta(t: Any) -> Any:
    return t.to(META) if torch.is_tensor(t) and t.device.type != "meta" else t


class MetaWithRealIntegers(TorchFunctionMode):
    """See the module docstring. Use as a context manager around a forward whose float inputs are on meta."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and _is_meta(kwargs.get("device")) and is_exact(_factory_dtype(func, args, kwargs)):
            kwargs["device"] = CPU
            return func(*args, **kwargs)
        if func is torch.Tensor.to and torch.is_tensor(args[0]) and is_exact(args[0].dtype):
            target = _target_device(args, kwargs)
            if args[0].device.type != "meta" and target is not None and target.type == "meta":
                dtype = next((a for a in args[1:] if isinstance(a, torch.dtype)), kwargs.get("dtype"))
                return args[0] if dtype is None else args[0].to(dtype)
        tensors = [t for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)]
        if func is torch.nn.functional.scaled_dot_product_attention and any(t.device.type == "meta" for t in tensors):
            return _attention(args, kwargs)
        if any(t.device.type == "meta" for t in tensors) and any(
            t.device.type != "meta" and t.dim() > 0 for t in tensors
        ):
            args, kwargs = tree_map(_to_meta, args), tree_map(_to_meta, kwargs)
        return func(*args, **kwargs)


def meta_like(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Float tensors as meta tensors of the same shape and dtype; integer and bool tensors as they are (on the CPU)."""
    return tuple(
        torch.empty_like(t, device=META) if torch.is_tensor(t) and not is_exact(t.dtype) else t for t in inputs
    )
