"""Every DeepSpeed behaviour we change, in one place, each with a test in tests/test_ds_patches.py.

1. ``ExplicitPartitionPipelineModule``: DeepSpeed's ``partition_method="parameters"`` counts only
   trainable parameters (so a LoRA run puts the whole frozen base model on one stage) and builds
   every layer to count them. We pass stage boundaries we computed ourselves (frozen parameters
   included, or the user's ``partition_split``).
2. ``OutputsRequireGrad``: DeepSpeed sends every float tensor a stage outputs to the next stage and
   later runs backward from it with the gradient it gets back. When a stage's layers are frozen (the
   embedders of a LoRA run) its outputs carry no autograd graph and that backward fails. Wrapping the
   last layer of each stage but the final one marks such outputs as leaves that require grad, so the
   backward is a no-op there. (Making the first layer's inputs require grad would also work, but it
   computes input gradients nobody needs.)
3. ``non_reentrant_checkpoint``: DeepSpeed's default activation checkpoint function breaks when the
   first layer returns several float tensors; torch's non-reentrant checkpoint does not.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint
from deepspeed.pipe import PipelineModule
from torch import nn


class ExplicitPartitionPipelineModule(PipelineModule):
    """A PipelineModule whose stage boundaries are given (``parts``: N+1 layer indices)."""

    def __init__(self, layers: list[Any], parts: list[int], **kwargs: Any) -> None:
        self._explicit_parts = list(parts)
        super().__init__(layers=layers, partition_method="explicit", **kwargs)

    def _partition_layers(self, method: str = "explicit") -> None:
        stage_id = self._topo.get_coord(self.global_rank).pipe
        if len(self._explicit_parts) != self.num_stages + 1:
            raise ValueError(f"need {self.num_stages + 1} boundaries, got {self._explicit_parts}")
        self.parts = self._explicit_parts
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])


def non_reentrant_checkpoint(function: Any, *args: Any) -> Any:
    """Activation checkpoint function for PipelineModule (``activation_checkpoint_func``)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


class OutputsRequireGrad(nn.Module):
    """Wraps the last layer of a non-final stage so every float output can receive a gradient."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, inputs: Any) -> Any:
        outputs = self.layer(inputs)
        if torch.is_tensor(outputs):  # keep a lone tensor a tensor: the next stage's layer expects what it got before
            return _require_grad(outputs)
        return tuple(_require_grad(x) for x in outputs)


def _require_grad(x: Any) -> Any:
    if torch.is_tensor(x) and x.is_floating_point() and not x.requires_grad:
        return x.requires_grad_(True)
    return x


def wrap_stage_boundaries(layers: list[nn.Module], parts: list[int]) -> list[nn.Module]:
    """Apply ``OutputsRequireGrad`` to the last layer of every stage except the final one."""
    out = list(layers)
    for stop in parts[1:-1]:
        out[stop - 1] = OutputsRequireGrad(out[stop - 1])
    return out
