"""``[ema]``: an exponential moving average of this stage's trained tensors.

After optimizer step ``s`` (1-based) the average is a copy of the weights while ``s <= start_step``; after that,
every ``every_n_steps``-th step (counted from ``start_step``) it becomes ``decay * ema + (1 - decay) * weights``.
A skipped (non-finite) step updates nothing. The average lives on the stage's device or in host memory
(``device = "cpu"``), is written in checkpoints (``ema/<name>`` keys of the stage's parameter file) and saved
beside the weights (``saved/<name>/ema/``); :meth:`EmaWeights.swapped_in` puts it into the model for samples
and eval losses (``use_for_samples``) and for saving.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from diffpipe_core.config import EmaConfig

CHECKPOINT_PREFIX = "ema/"


class EmaWeights:
    """The average of ``trainable`` (this stage's trained tensors, by model name)."""

    def __init__(self, cfg: EmaConfig, trainable: dict[str, torch.Tensor]) -> None:
        self.cfg, self.trainable = cfg, trainable
        device = torch.device("cpu") if cfg.device == "cpu" else None
        self.average = {n: p.detach().to(device or p.device, copy=True) for n, p in trainable.items()}

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based, just taken) updates the average, or only copies the weights."""
        return step > self.cfg.start_step and (step - self.cfg.start_step) % self.cfg.every_n_steps == 0

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step ``step`` (1-based): copy the weights (up to ``start_step``) or average them in."""
        if step <= self.cfg.start_step:
            for name, p in self.trainable.items():
                self.average[name].copy_(p.detach())
        elif self.due(step):
            for name, p in self.trainable.items():
                avg = self.average[name]
                avg.lerp_(p.detach().to(avg.device, avg.dtype), 1.0 - self.cfg.decay)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The average under ``ema/<name>`` keys, written beside the trained tensors in the checkpoint."""
        return {CHECKPOINT_PREFIX + n: t for n, t in self.average.items()}

    @torch.no_grad()
    def load(self, saved: dict[str, torch.Tensor]) -> bool:
        """Take the average from a checkpoint's tensors (every stage's, by name); False (the average restarts from
        the weights) when the checkpoint has none, e.g. a run that turned ``[ema]`` on at its resume."""
        keys = [CHECKPOINT_PREFIX + n for n in self.average]
        if not all(k in saved for k in keys):
            for name, p in self.trainable.items():
                self.average[name].copy_(p.detach())
            return False
        for name, key in zip(self.average, keys, strict=True):
            self.average[name].copy_(saved[key])
        return True

    @contextlib.contextmanager
    def swapped_in(self, active: bool = True) -> Iterator[None]:
        """Inside the block the model's trained tensors hold the average (and the average the weights); swapped
        back after. One tensor's copy at a time: no second copy of the stage's weights."""
        if not active:
            yield
            return
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _swap(self) -> None:
        swap_(self.trainable, self.average)


@torch.no_grad()
def swap_(trainable: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> None:
    """Exchange the values of the model's tensors ``trainable`` and ``other`` (same names; ``other`` may live in host
    memory), one tensor's copy at a time."""
    for name, p in trainable.items():
        held_in = other[name]
        held = p.detach().to(held_in.device, copy=True)
        p.copy_(held_in)
        held_in.copy_(held)
