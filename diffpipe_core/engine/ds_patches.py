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
   computes input gradients nobody needs.) It also makes them contiguous: gloo sends only contiguous
   tensors, and a transposed patch embedding is not.
3. ``name_gradless_boundary_tensors``: a float tensor that crosses a stage boundary but that the next
   stages never use gets no gradient, and DeepSpeed then stops the first step with a bare
   ``assert buffer.grad is not None`` in ``_exec_send_grads``. We check first and raise
   :class:`StageBoundaryError` naming the layer that produced the tensor and its index.
4. ``forward_outputs``: ``PipelineEngine.eval_batch(compute_loss=False)`` adds each micro-batch's outputs
   to ``total_loss``, which still holds the last ``train_batch``'s scalar loss, and fails indexing it. We
   clear it for the call and put it back (used by diffpipe_core.sampling.pipeline).
5. ``keep_compiled_backward_buffers``: a stage that is not the last runs backward one output tensor at a time,
   with ``retain_graph=True`` for all but the last (``PipelineEngine._exec_backward_pass``). The backward of a
   ``torch.compile``'d layer donates its saved buffers and refuses a retained graph ("compiled with non-empty
   donated buffers"), so ``compile`` broke every run of more than one stage. With ``compile`` on we turn buffer
   donation off: the compiled backward keeps its saved tensors, as eager autograd does.

Activation checkpointing no longer goes through DeepSpeed (whose default checkpoint function broke on a
first layer with several float outputs): diffpipe_core.memory wraps the block layers itself.
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
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
    if not torch.is_tensor(x):
        return x
    x = x.contiguous()  # gloo sends only contiguous tensors
    if x.is_floating_point() and not x.requires_grad:
        return x.requires_grad_(True)
    return x


def wrap_stage_boundaries(layers: list[nn.Module], parts: list[int]) -> list[nn.Module]:
    """Apply ``OutputsRequireGrad`` to the last layer of every stage except the final one."""
    out = list(layers)
    for stop in parts[1:-1]:
        out[stop - 1] = OutputsRequireGrad(out[stop - 1])
    return out


class StageBoundaryError(RuntimeError):
    """A float tensor crossing a pipeline stage boundary is not used by the stages after it."""


def name_gradless_boundary_tensors(engine: PipelineEngine, producer: str) -> None:
    """Check, before DeepSpeed sends gradients back to the previous stage, that every float tensor this stage
    received got one; otherwise raise :class:`StageBoundaryError` naming ``producer`` (the previous stage's
    last layer, e.g. ``"layer 3 (EmbedLayer)"``) and the tensor's index. Applies to this engine only."""

    def send_grads(self: PipelineEngine, buffer_id: int) -> None:
        inputs = self.pipe_buffers["inputs"][buffer_id]
        received = inputs if isinstance(inputs, tuple) else (inputs,)
        for index, tensor in enumerate(received):
            if torch.is_tensor(tensor) and tensor.is_floating_point() and tensor.grad is None:
                raise StageBoundaryError(
                    f"pipeline stage {self.stage_id}: output {index} of {producer} (shape {tuple(tensor.shape)}, "
                    f"{tensor.dtype}) got no gradient: no later layer uses it. Every float tensor a layer returns "
                    "must be used downstream (pass integer tensors for sizes, or stop returning it)"
                )
        PipelineEngine._exec_send_grads(self, buffer_id)

    engine._INSTRUCTION_MAP = {**type(engine)._INSTRUCTION_MAP, schedule.SendGrad: send_grads}


def forward_outputs(engine: PipelineEngine, data_iter: Any, num_micro_batches: int) -> list[Any] | None:
    """A forward-only pass of ``num_micro_batches`` through the pipeline (no loss): on the last stage each
    micro-batch's outputs (a list of tensors), elsewhere None."""
    saved = engine.total_loss
    engine.total_loss = None
    try:
        return engine.eval_batch(
            data_iter, compute_loss=False, reduce_output=None, bcast_loss=False, num_micro_batches=num_micro_batches
        )
    finally:
        engine.total_loss = saved


def keep_compiled_backward_buffers() -> None:
    """Let compiled layers' backward run under DeepSpeed's per-output ``retain_graph=True`` backward (patch 5).
    Process-wide torch setting; called before the blocks are compiled."""
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False
