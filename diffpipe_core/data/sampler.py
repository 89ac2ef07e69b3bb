"""Bucket-homogeneous, data-parallel, resumable micro-batch order."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

log = logging.getLogger("diffpipe.data")


class BucketSampler:
    """Micro-batches of sample indices that never mix buckets, split over data-parallel ranks.

    Each epoch, from ``seed`` and the epoch number alone: every bucket's indices are shuffled and cut
    into micro-batches of ``micro_batch_size`` (one size for all, or one per group: per-resolution sizes); all full
    micro-batches are shuffled together; rank ``r``
    takes micro-batches ``r, r + dp, r + 2 dp, ...`` of the first ``dp * floor(count / dp)``, so every
    rank gets the same number and the shares are disjoint.

    Samples that fill no micro-batch (a bucket's last ``len % micro_batch_size``, and the micro-batches
    beyond the last multiple of ``dp``) sit out that epoch; ``remainder`` counts them so the engine can
    report it. They are not dropped from training: the next epoch reshuffles, so other samples sit out.

    ``state_dict`` holds the epoch and the position (micro-batches already yielded by ``__iter__`` this
    epoch); after ``load_state_dict`` iteration continues from there, also under another data-parallel degree:
    the ranks together have taken the first ``position * dp`` micro-batches of the epoch's order, and the new ranks
    go on from there. When an epoch's iteration runs to its end the sampler moves to the next epoch.
    """

    def __init__(self, groups: list[list[int]], micro_batch_size: int | Sequence[int], dp_rank: int,
                 dp_world_size: int, seed: int, data: str | None = None) -> None:
        sizes = [micro_batch_size] * len(groups) if isinstance(micro_batch_size, int) else list(micro_batch_size)
        if len(sizes) != len(groups):
            raise ValueError(f"{len(sizes)} micro-batch sizes for {len(groups)} groups")
        if any(size < 1 for size in sizes):
            raise ValueError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_world_size - 1}")
        kept = [(list(map(int, g)), size) for g, size in zip(groups, sizes) if len(g)]
        self.groups = [g for g, _ in kept]
        self.sizes = [size for _, size in kept]
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seed = int(seed)
        self.data = data  # which samples the indices are (:func:`data_key`): a resume on other data says so
        self.note: str | None = None  # why load_state_dict restarted the saved epoch, if it did
        self.epoch = 0
        self.position = 0
        full = sum(len(g) // size for g, size in kept)
        self._full = full
        self._per_rank = full // dp_world_size
        total = sum(len(g) for g in self.groups)
        self.remainder = total - sum(len(b) for b in self._all_batches(0)[: self._per_rank * dp_world_size])
        if self._per_rank == 0:
            described = ", ".join(f"{len(g)} samples (micro-batch {size})" for g, size in kept)
            raise ValueError(
                f"the dataset gives {full} full micro-batch(es) (buckets: {described}) for {dp_world_size} "
                "data-parallel rank(s); lower micro_batch_size_per_gpu or add data"
            )

    def __len__(self) -> int:
        return self._per_rank

    def _all_batches(self, epoch: int) -> list[list[int]]:
        """Every rank's full micro-batches of ``epoch`` in the shuffled order the ranks take them from."""
        rng = np.random.default_rng([self.seed, epoch])
        batches: list[list[int]] = []
        for group, size in zip(self.groups, self.sizes):
            order = rng.permutation(np.asarray(group))
            usable = len(order) - len(order) % size
            batches += [order[s : s + size].tolist() for s in range(0, usable, size)]
        perm = rng.permutation(len(batches))
        return [batches[i] for i in perm]

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches of ``epoch`` (deterministic from seed and epoch)."""
        kept = self._all_batches(epoch)[: self._per_rank * self.dp_world_size]
        return kept[self.dp_rank :: self.dp_world_size]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.epoch_batches(self.epoch)
        while self.position < len(batches):
            batch = batches[self.position]
            self.position += 1
            yield batch
        self.epoch += 1
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; setting the current epoch keeps the position (resume)."""
        if epoch != self.epoch:
            self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "micro_batches": self._per_rank, "dp_world_size": self.dp_world_size, "data": self.data}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore epoch and position; under another data-parallel degree the epoch's order goes on from the
        micro-batches the saved ranks took together (rounded down to a whole number per new rank). A changed
        dataset, seed or micro-batch size restarts the saved epoch (a changed dataset, which no config key shows, is
        said in :attr:`note`)."""
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.note = None
        saved_data = state.get("data")
        if saved_data is not None and self.data is not None and saved_data != self.data:
            then, now = saved_data.split(":", 1)[0], self.data.split(":", 1)[0]
            self.note = (f"the dataset changed since the checkpoint ({then} samples then, {now} now): the epoch "
                         "starts over in the new data's order")
            self.position = 0
        saved_dp = int(state.get("dp_world_size", self.dp_world_size))
        # the same epoch order (seed, and as many micro-batches per saved rank as the saved ranks took)
        same_order = (state.get("seed", self.seed) == self.seed
                      and state.get("micro_batches", self._full // saved_dp) == self._full // saved_dp)
        if saved_dp != self.dp_world_size and same_order:
            self.position = self.position * saved_dp // self.dp_world_size  # the epoch's order goes on
            if self.position >= self._per_rank:
                self.epoch, self.position = self.epoch + 1, 0
        elif not same_order:
            log.warning("sampler state was saved for another dataset, seed or micro-batch size "
                        "(%s); restarting epoch %d from its beginning", state, self.epoch)
            self.position = 0


def data_key(sample_ids: Sequence[str]) -> str:
    """``"<count>:<sha256>"`` of a dataset's samples (their ids, in index order): what a checkpoint's sampler state
    was made for. The ids' common folder is left out, so a project moved or copied with its data elsewhere resumes
    where it stopped."""
    import hashlib
    import os

    folders = [os.path.dirname(i) for i in sample_ids]
    try:
        common = os.path.commonpath(folders) if folders else ""
    except ValueError:  # absolute and relative ids mixed, or other drives
        common = ""
    relative = [i[len(common):] for i in sample_ids]
    digest = hashlib.sha256("\0".join(relative).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{len(sample_ids)}:{digest}"
