"""Every DeepSpeed behaviour we change, in one place, each with a test in tests/test_ds_patches.py.

1. ``ExplicitPartitionPipelineModule``: DeepSpeed's ``partition_method="parameters"`` counts only
   trainable parameters (so a LoRA run puts the whole frozen base model on one stage) and builds
   every layer to count them. We pass stage boundaries we computed ourselves (frozen parameters
   included, or the user's ``partition_split``).
2. ``InputsRequireGrad``: DeepSpeed hands the first stage its inputs detached. When the first layers are
   frozen (LoRA), their outputs then carry no autograd graph, and the backward pass of the next stage
   has nothing to send gradients into. Wrapping the first layer makes its float inputs require grad.
3. ``non_reentrant_checkpoint``: DeepSpeed's default activation checkpoint function breaks when the
   first layer returns several float tensors; torch's non-reentrant checkpoint does not.
"""

from __future__ import annotations

from typing import Any

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


class InputsRequireGrad(nn.Module):
    """Wraps the first pipeline layer so that its float inputs are part of the autograd graph."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, inputs: tuple[Any, ...]) -> Any:
        inputs = tuple(
            x.requires_grad_(True) if hasattr(x, "is_floating_point") and x.is_floating_point() else x for x in inputs
        )
        return self.layer(inputs)
