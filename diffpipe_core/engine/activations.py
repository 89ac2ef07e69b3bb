"""What each pipeline layer keeps for backward, measured once with a forward on the meta device.

The layers run one after the other on their meta twin (same modules, weights on meta, the run's adapter injected
and trainable), from the first layer's real inputs made meta. A ``saved_tensors_hooks`` pair records every tensor
autograd saves while each layer runs; weights are left out (they are counted as weights), and each storage is
known by identity, so a tensor several layers save (a rotary embedding every block uses) is counted once per
stage, not once per layer. The inputs and float outputs of each layer are recorded the same way: what activation
checkpointing keeps, and what a stage boundary sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from diffpipe_core.engine.meta_forward import MetaWithRealIntegers, is_exact, meta_like


def storage_id(t: torch.Tensor) -> int:
    """An id shared by all views of one storage (valid while the tensor is alive)."""
    return t.untyped_storage()._cdata


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@dataclass
class LayerTensors:
    """The tensors of one layer's forward, each as ``{storage id: bytes}``."""

    saved: dict[int, int] = field(default_factory=dict)
    inputs: dict[int, int] = field(default_factory=dict)
    outputs: dict[int, int] = field(default_factory=dict)
    measured: bool = True


@dataclass
class Measurement:
    """Per-layer tensors; ``failed`` names the first layer whose meta forward failed and why (None: all ran)."""

    layers: list[LayerTensors]
    failed: str | None = None
    # the stage plan's per-interval tables made from these layers, by how they are kept (engine/stage_plan.py): the
    # GPU-fit planner plans many candidates over one measurement
    tables: dict = field(default_factory=dict, repr=False, compare=False)


def _as_tuple(x: object) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def measure_layers(layers: list[nn.Module], inputs: tuple[torch.Tensor, ...]) -> Measurement:
    """Run ``layers`` (holding meta weights) in order from ``inputs`` (any device: floats are made meta, with
    ``requires_grad`` as DeepSpeed's first stage sets it) and record what each keeps for backward.

    A layer that cannot run on meta ends the measurement there: it and the layers after it borrow the numbers of
    the last measured layer of the same class and size (the repeated blocks), or count nothing.
    """
    weights = {storage_id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    keep_alive: list[torch.Tensor] = []  # storage ids stay unique while every tensor seen is alive

    def record(tensors: object, into: dict[int, int], floats_only: bool = False) -> None:
        for t in _as_tuple(tensors):
            if torch.is_tensor(t) and not (floats_only and is_exact(t.dtype)):
                key = storage_id(t)
                if key not in weights:
                    into[key] = storage_bytes(t)
                    keep_alive.append(t)

    results: list[LayerTensors] = []
    failed = None
    x = tuple(t.requires_grad_() if not is_exact(t.dtype) else t for t in meta_like(tuple(inputs)))
    with torch.enable_grad(), MetaWithRealIntegers():
        for i, layer in enumerate(layers):
            current = LayerTensors()
            record(x, current.inputs)

            def pack(t: torch.Tensor, into: dict[int, int] = current.saved) -> torch.Tensor:
                record(t, into)
                return t

            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    x = _as_tuple(layer(x))
            except Exception as exc:  # a layer that needs real data (a data-dependent shape): see the docstring
                failed = f"layer {i} ({type(layer).__name__}): {type(exc).__name__}: {str(exc)[:200]}"
                break
            record(x, current.outputs, floats_only=True)
            results.append(current)
    if failed is not None:
        results.extend(_borrowed(layers, results, len(layers) - len(results)))
    return Measurement(results, failed)


def _signature(layer: nn.Module) -> tuple[str, int]:
    return type(layer).__name__, sum(p.numel() for p in layer.parameters())


def _borrowed(layers: list[nn.Module], measured: list[LayerTensors], missing: int) -> list[LayerTensors]:
    """Stand-ins for the layers after a failed one: a copy (with fresh ids, nothing shared) of the last measured
    layer of the same class and parameter count, else nothing."""
    out = []
    start = len(measured)
    for i in range(start, start + missing):
        like = [m for j, m in enumerate(measured) if _signature(layers[j]) == _signature(layers[i])]
        twin = like[-1] if like else None
        if twin is None:
            out.append(LayerTensors(measured=False))
            continue
        fresh = [  # negative ids never clash with real storage ids
            {-(((3 * i + kind) << 20) + k + 1): b for k, b in enumerate(d.values())}
            for kind, d in enumerate((twin.saved, twin.inputs, twin.outputs))
        ]
        out.append(LayerTensors(*fresh, measured=False))
    return out
