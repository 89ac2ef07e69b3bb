"""Forward passes for sampling: through the training ``PipelineEngine`` (no second model copy, any number
of stages), or through a plain chain of the plugin's layers in one process.

``PipelineEngine.eval_batch(compute_loss=False, reduce_output=None)`` runs the inference schedule and
returns, on the last stage, each micro-batch's outputs (through
:func:`diffpipe_core.engine.ds_patches.forward_outputs`). The last stage then broadcasts the prediction (the
first output tensor) to the other stages of its pipeline, so every rank runs the same denoising loop and
the first stage can build the next step's inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from diffpipe_core.engine.ds_patches import forward_outputs

Tensors = tuple[torch.Tensor, ...]
_MAX_DIMS = 8


class PipelineForward:
    """``forward(inputs) -> predictions`` through a DeepSpeed ``PipelineEngine`` (called on every rank)."""

    def __init__(self, engine: Any, device: torch.device) -> None:
        self.engine, self.device = engine, device
        self.num_stages = engine.num_stages
        self.group = engine.grid.get_pipe_parallel_group() if self.num_stages > 1 else None
        self.src = engine.grid.stage_to_global(stage_id=self.num_stages - 1) if self.num_stages > 1 else None

    def __call__(self, inputs: list[Tensors]) -> list[torch.Tensor]:
        # One pass per run of same-shaped inputs: DeepSpeed adds up the micro-batches' outputs of one pass, which
        # fails for outputs of different shapes (an edit model's prompt with a control image and one without).
        # Every rank holds the same inputs, so every rank cuts them the same way.
        last = self.engine.is_last_stage()
        predictions: list[torch.Tensor | None] = []
        for group in _same_shapes(inputs):
            # The last stage loads a micro-batch's labels too; sampling has none, so a placeholder goes there.
            data = iter([(tuple(x), (torch.zeros(1),)) for x in group])
            outputs = forward_outputs(self.engine, data, len(group))
            predictions += [_first(out).detach().float() for out in outputs] if last else [None] * len(group)
        if self.num_stages > 1:
            predictions = [self._broadcast(p) for p in predictions]
        return [p.cpu() for p in predictions]

    def unconditional(self, chain: Any) -> Any:
        """A forward for the unconditional model that every rank calls: ``chain`` (the last stage's
        :class:`LayerChainForward` over it; None on the other stages) runs it, the last stage broadcasts its
        predictions to its pipeline, as :meth:`__call__` does."""

        def run(inputs: list[Tensors]) -> list[torch.Tensor]:
            predictions = chain(inputs) if chain is not None else [None] * len(inputs)
            if self.num_stages > 1:
                predictions = [self._broadcast(p) for p in predictions]
            return [p.cpu() for p in predictions]

        return run

    def _broadcast(self, tensor: torch.Tensor | None) -> torch.Tensor:
        header = torch.zeros(_MAX_DIMS + 1, dtype=torch.long, device=self.device)
        if tensor is not None:
            if tensor.dim() > _MAX_DIMS:
                raise ValueError(f"a prediction with {tensor.dim()} dimensions; sampling supports up to {_MAX_DIMS}")
            header[0] = tensor.dim()
            header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.long)
        dist.broadcast(header, src=self.src, group=self.group)
        shape = tuple(int(v) for v in header[1 : 1 + int(header[0])])
        buf = tensor.to(self.device).contiguous() if tensor is not None else torch.empty(shape, device=self.device)
        dist.broadcast(buf, src=self.src, group=self.group)
        return buf


def _same_shapes(inputs: list[Tensors]) -> list[list[Tensors]]:
    """``inputs`` cut into consecutive runs whose tensors have the same shapes, in order."""
    groups: list[list[Tensors]] = []
    for x in inputs:
        shapes = [tuple(t.shape) for t in x]
        if groups and [tuple(t.shape) for t in groups[-1][0]] == shapes:
            groups[-1].append(x)
        else:
            groups.append([x])
    return groups


class LayerChainForward:
    """``forward(inputs) -> predictions`` through the plugin's layers in this process, one after another."""

    def __init__(self, layers: Sequence[nn.Module], device: torch.device | str = "cpu") -> None:
        self.layers, self.device = list(layers), torch.device(device)

    @torch.no_grad()
    def __call__(self, inputs: list[Tensors]) -> list[torch.Tensor]:
        predictions = []
        for x in inputs:
            out: Any = tuple(t.to(self.device) for t in x)
            for layer in self.layers:
                out = layer(out)
            predictions.append(_first(out).detach().float().cpu())
        return predictions


def _first(out: Any) -> torch.Tensor:
    if torch.is_tensor(out):
        return out
    return out[0]
