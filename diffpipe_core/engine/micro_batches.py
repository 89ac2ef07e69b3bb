"""The micro-batches DeepSpeed pulls: sampler -> collate -> ``prepare_inputs``, each with its own seeded generator.

The noise, timesteps and caption dropout of micro-batch ``m`` come from a generator seeded by
``(seed, m, data-parallel rank)``, so a resumed run draws exactly what the uninterrupted run would have, and the
first and last pipeline stages, which both draw each micro-batch, agree on it.
"""

from __future__ import annotations

from typing import Any

import torch

from diffpipe_core.config import RunConfig
from diffpipe_core.registry import ModelPlugin
from diffpipe_core.types import TrainingContext


def mix_seed(*parts: int) -> int:
    """One 63-bit seed from several integers (FNV-style), stable across processes and runs."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def global_micro_batch(micro_index: int, dp: int, dp_rank: int) -> int:
    """The number of a rank's ``micro_index``-th micro-batch in the run's single sequence of micro-batches (the
    sampler's global order interleaves the ranks): the same micro-batch has the same number on any layout."""
    return micro_index * dp + dp_rank


def bucket_sizes(run: RunConfig, dataset: Any, groups: list[list[int]]) -> list[int]:
    """The micro-batch size of each bucket group of ``dataset`` (``micro_batch_size_per_gpu`` may be per resolution)."""
    sizes = []
    for group in groups:
        bucket = dataset.bucket_of(group[0]) if group else None
        sizes.append(run.micro_batch_size_for(bucket.width, bucket.height, bucket.frames) if bucket else 1)
    return sizes


def full_micro_batches(run: RunConfig, dataset: Any) -> int:
    """How many full micro-batches an epoch of ``dataset`` gives (all data-parallel ranks together): a layout of
    ``dp`` replicas trains when ``full_micro_batches // dp >= gradient_accumulation_steps`` (the trainer's rule,
    through :class:`~diffpipe_core.data.BucketSampler`)."""
    groups = [g for g in dataset.groups() if len(g)]
    return sum(len(g) // size for g, size in zip(groups, bucket_sizes(run, dataset, groups)))


class MicroBatches:
    """The iterator DeepSpeed pulls micro-batches from: sampler -> collate -> prepare_inputs."""

    def __init__(
        self,
        dataset: Any,
        sampler: Any,
        plugin: ModelPlugin,
        context: TrainingContext,
        seed: int,
        dp_rank: int,
        micro_index: int,
        dp: int = 1,
    ) -> None:
        self.dataset, self.sampler, self.plugin, self.context = dataset, sampler, plugin, context
        self.seed, self.dp_rank, self.dp, self.micro_index = seed, dp_rank, dp, micro_index
        self.step_ids: list[str] = []  # one per sample drawn since the trainer last emptied it
        self._it = iter(sampler)

    def __iter__(self) -> MicroBatches:
        return self

    def __next__(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        indices, micro_index = self.draw()
        self.step_ids.extend(self.dataset.sample_ids(indices))
        return self.make(indices, micro_index)

    def draw(self) -> tuple[list[int], int]:
        """The next micro-batch's sample indices and number (the sampler moves on; a new epoch reshuffles)."""
        try:
            indices = next(self._it)
        except StopIteration:
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self._it = iter(self.sampler)
            indices = next(self._it)
        self.micro_index += 1
        return indices, self.micro_index - 1

    def make(
        self, indices: list[int], micro_index: int, uncond: bool = False, class_prompt: bool = False
    ) -> tuple[tuple[Any, ...], ...]:
        """Micro-batch ``micro_index`` of ``indices``: collated and prepared with its own seeded generator, so the
        same call gives the same noise and timesteps. ``uncond``: every caption is the empty prompt;
        ``class_prompt``: each item's class prompt (``diff_output_preservation``)."""
        # seeded by the micro-batch's global number, so its noise is the same on any layout (0: the seed of
        # data-parallel rank 0 before global numbers, so one-rank runs draw what they drew)
        generator = torch.Generator().manual_seed(
            mix_seed(self.seed, global_micro_batch(micro_index, self.dp, self.dp_rank), 0)
        )
        if uncond:
            batch = self.dataset.collate(indices, generator, uncond=True)
        elif class_prompt:
            batch = self.dataset.collate(indices, generator, class_prompt=True)
        else:
            batch = self.dataset.collate(indices, generator)
        return self.plugin.require("prepare_inputs", batch=batch, context=self.context, generator=generator)
