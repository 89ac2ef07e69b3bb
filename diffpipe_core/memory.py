"""Memory savers for a stage's blocks: block swapping and activation checkpointing (optionally offloaded).

Both wrap pipeline layers, so they work with any number of stages and any model that names its block layers
in ``ModelSpec.block_layers``. The nesting is ``SwappedBlock(CheckpointedLayer(layer))``: a swapped block's
weights arrive before its (re)computation in backward, since the recomputation runs inside the checkpoint.

Block swap: the frozen weights of N blocks live in host memory (pinned when there is a GPU). A block's weights
are copied in just before it runs, on a side stream while the previous block computes, and dropped right after
(they are frozen, so the host copy is still current): in forward after the block, in backward after its
gradients. LoRA (trainable) weights never move. On a CPU-only run host and device are the same memory, so the
same code runs and nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn


class CheckpointedLayer(nn.Module):
    """Recompute the wrapped layer's activations in backward (torch's non-reentrant checkpoint). With
    ``offload``, the tensors the checkpoint keeps (the layer's inputs) wait for backward in host memory."""

    def __init__(self, layer: nn.Module, offload: bool) -> None:
        super().__init__()
        self.layer, self.offload = layer, offload

    def forward(self, inputs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.layer(inputs)
        if self.offload:
            with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                return torch.utils.checkpoint.checkpoint(self.layer, inputs, use_reentrant=False)
        return torch.utils.checkpoint.checkpoint(self.layer, inputs, use_reentrant=False)


def _stored_buffers(module: nn.Module) -> list[torch.Tensor]:
    """A kept-quantized linear's stored weight and scale (buffers of :class:`~diffpipe_core.quantize.ScaledLinear`,
    ``GGUFLinear``: the names in their ``stored_buffers``), which move with its block as its weights do."""
    return [t for n in getattr(module, "stored_buffers", ()) if (t := module._buffers.get(n)) is not None]


class _HostWeights:
    """One block's frozen float parameters (and a quantized base's stored weights) and their host copies."""

    def __init__(self, layer: nn.Module, device: torch.device) -> None:
        self.device = device
        self.params = [p for p in layer.parameters() if not p.requires_grad and p.is_floating_point()]
        self.params += [t for m in layer.modules() for t in _stored_buffers(m)]
        pin = device.type == "cuda"
        self.host = [p.detach().to("cpu").pin_memory() if pin else p.detach().to("cpu") for p in self.params]
        self.loaded = False
        self.ready: torch.cuda.Event | None = None

    def drop(self) -> None:
        for p, h in zip(self.params, self.host):
            p.data = h
        self.loaded, self.ready = False, None


class BlockSwapper:
    """Moves the frozen weights of ``layers`` (in forward order) between host memory and ``device``."""

    def __init__(self, layers: Sequence[nn.Module], device: torch.device) -> None:
        self.device = device
        self.blocks = [_HostWeights(layer, device) for layer in layers]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        for block in self.blocks:
            block.drop()

    def load(self, index: int) -> None:
        """Make block ``index``'s weights usable on the current stream (waiting for a prefetch if one runs)."""
        block = self.blocks[index]
        if not block.loaded:
            self._copy_in(block, self.stream is not None)
        if block.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(block.ready)
            for p in block.params:
                p.data.record_stream(current)  # the side stream allocated it; keep it alive for this stream's use
            block.ready = None

    def prefetch(self, index: int) -> None:
        """Start copying block ``index`` in on the side stream (no-op on CPU or when out of range)."""
        if self.stream is not None and 0 <= index < len(self.blocks) and not self.blocks[index].loaded:
            self._copy_in(self.blocks[index], asynchronous=True)

    def drop(self, index: int) -> None:
        self.blocks[index].drop()

    def _copy_in(self, block: _HostWeights, asynchronous: bool) -> None:
        if asynchronous:
            assert self.stream is not None
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for p, h in zip(block.params, block.host):
                    p.data = h.to(self.device, non_blocking=True)
                block.ready = torch.cuda.Event()
                block.ready.record(self.stream)
        else:
            for p, h in zip(block.params, block.host):
                p.data = h.to(self.device)
        block.loaded = True


class _Boundary(torch.autograd.Function):
    """Identity on a block's inputs or outputs; its backward runs a callback at that point of backward."""

    @staticmethod
    def forward(ctx: Any, callback: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


def _through(callback: Any, values: Any) -> Any:
    """Route the float tensors that require grad in ``values`` through a :class:`_Boundary`."""
    single = torch.is_tensor(values)
    items = (values,) if single else tuple(values)
    picked = [i for i, t in enumerate(items) if torch.is_tensor(t) and t.is_floating_point() and t.requires_grad]
    if not picked:
        return values
    routed = _Boundary.apply(callback, *(items[i] for i in picked))
    out = list(items)
    for i, t in zip(picked, routed):
        out[i] = t
    return out[0] if single else tuple(out)


class SwappedBlock(nn.Module):
    """A pipeline layer whose frozen weights are swapped in around its forward and its backward."""

    def __init__(self, layer: nn.Module, swapper: BlockSwapper, index: int) -> None:
        super().__init__()
        self.layer, self.swapper, self.index = layer, swapper, index

    def forward(self, inputs: Any) -> Any:
        swapper, i = self.swapper, self.index
        if torch.is_grad_enabled():
            # the gradient reaching our inputs means this block's backward is done: drop its weights again.
            # An input that needs no gradient is made to need one, so that point is always reached.
            inputs = _make_float_inputs_require_grad(inputs)
            inputs = _through(lambda: swapper.drop(i), inputs)
        swapper.load(i)
        swapper.prefetch(i + 1)
        outputs = self.layer(inputs)
        swapper.drop(i)
        if torch.is_grad_enabled():
            outputs = _through(lambda: (swapper.load(i), swapper.prefetch(i - 1)), outputs)
        return outputs

    def _apply(self, fn: Any, recurse: bool = True) -> SwappedBlock:
        # Keep swapped weights out of module.to(device): PipelineModule and DeepSpeed move the whole stage to
        # the device, which would put every swapped block on the GPU at once.
        swapped = self.swapper.blocks[self.index].params
        held = [(m, table, name, p) for m in self.layer.modules() for table in (m._parameters, m._buffers)
                for name, p in list(table.items()) if p is not None and any(p is q for q in swapped)]
        for _, table, name, _ in held:
            del table[name]
        try:
            return super()._apply(fn, recurse)
        finally:
            for _, table, name, p in held:
                table[name] = p


def _make_float_inputs_require_grad(inputs: Any) -> Any:
    if torch.is_tensor(inputs):
        return inputs if not inputs.is_floating_point() or inputs.requires_grad else inputs.detach().requires_grad_()
    return tuple(
        t.detach().requires_grad_() if torch.is_tensor(t) and t.is_floating_point() and not t.requires_grad else t
        for t in inputs
    )


def stage_blocks(layers: Sequence[nn.Module], own: range, block_layers: Sequence[str]) -> list[int]:
    """Indices (within ``own``) of the stage's block layers."""
    return [i for i in own if type(layers[i]).__name__ in block_layers]


def swapped_blocks(layers: Sequence[nn.Module], own: range, block_layers: Sequence[str], n: int) -> list[int]:
    """The last ``n`` blocks of the stage: their frozen weights live in host memory."""
    blocks = stage_blocks(layers, own, block_layers)
    return blocks[len(blocks) - min(n, len(blocks)) :] if n else []


def wrap_stage_layers(
    layers: list[nn.Module],
    own: range,
    block_layers: Sequence[str],
    checkpointing: bool | str,
    blocks_to_swap: int,
    device: torch.device,
) -> tuple[list[nn.Module], int]:
    """Wrap this stage's layers (indices ``own``) for activation checkpointing and block swapping.

    Checkpointing covers the stage's block layers (every layer when the model names none); the last
    ``blocks_to_swap`` of the stage's blocks are swapped. Returns the new layer list and how many blocks swap.
    """
    out = list(layers)
    if checkpointing:
        for i in stage_blocks(layers, own, block_layers) if block_layers else own:
            out[i] = CheckpointedLayer(out[i], offload=checkpointing == "offload")
    swapped = swapped_blocks(layers, own, block_layers, blocks_to_swap)
    if swapped:
        swapper = BlockSwapper([layers[i] for i in swapped], device)
        for k, i in enumerate(swapped):
            out[i] = SwappedBlock(out[i], swapper, k)
    return out, len(swapped)
