"""Random numbers inside the layers (LoRA dropout, rank and module dropout, a model's own dropout) that do not
depend on the process layout.

Every pipeline layer is wrapped by :class:`SeededLayer`: before a training forward it seeds torch's generators from
the run's seed, the micro-batch's global number (the same micro-batch has the same number whatever the stages and
data-parallel ranks) and the layer's index in the whole pipeline. So a layer draws the same masks for the same
micro-batch on any layout, and a run resumed on another layout repeats the run. The seeding happens outside
activation checkpointing, which saves the seeded state and restores it for the recomputation in backward.

Seeding is :func:`seed_generators`, not ``torch.manual_seed``: the latter also queues a lazy seed for every device
library not yet started (CUDA on a CPU run, XPU and MTIA everywhere), and each queued seed formats the whole Python
stack for its debug record. Inside DeepSpeed's pipeline engine that cost about 1 ms per layer per micro-batch on a
loaded 2-core machine: the largest part of the step-time benches' overhead after the re-faulted heap
(:mod:`diffpipe_core.engine.host_memory`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from diffpipe_core.engine.micro_batches import global_micro_batch, mix_seed


def seed_generators(seed: int) -> None:
    """Seed the generators a layer can draw from: the CPU's and, once CUDA is started, every CUDA device's (what
    ``torch.manual_seed`` seeds that diffpipe runs on), without queueing lazy seeds for device libraries that are
    not started (each of which formats the Python stack)."""
    torch.random.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


class LayerSeeds:
    """One stage's micro-batch count, shared by its :class:`SeededLayer` wrappers.

    ``micro_index``: this rank's training micro-batches started so far (restored on resume); the first layer of the
    stage counts each training forward."""

    def __init__(self, seed: int, first_layer: int, dp: int, dp_rank: int) -> None:
        self.seed, self.first_layer, self.dp, self.dp_rank = seed, first_layer, dp, dp_rank
        self.micro_index = 0
        self._current = 0

    def enter(self, layer_index: int) -> None:
        """Seed torch's generators for ``layer_index``'s training forward of the current micro-batch."""
        if layer_index == self.first_layer:
            self._current = global_micro_batch(self.micro_index, self.dp, self.dp_rank)
            self.micro_index += 1
        seed_generators(mix_seed(self.seed, self._current, layer_index))


class SeededLayer(nn.Module):
    """A pipeline layer whose training forward starts from :class:`LayerSeeds`' seed for it."""

    def __init__(self, layer: nn.Module, index: int, seeds: LayerSeeds) -> None:
        super().__init__()
        self.layer, self.index, self.seeds = layer, index, seeds

    def forward(self, inputs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            self.seeds.enter(self.index)
        return self.layer(inputs)


def seed_stage_layers(layers: list[nn.Module], own: range, seeds: LayerSeeds) -> list[nn.Module]:
    """This stage's layers (indices ``own``) wrapped by :class:`SeededLayer`; the others as they are."""
    return [SeededLayer(layer, i, seeds) if i in own else layer for i, layer in enumerate(layers)]
