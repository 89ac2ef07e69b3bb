"""``[optimizer] gradient_release = true``: each parameter is stepped as soon as its gradient is complete.

A post-accumulate-grad hook on every trained parameter runs the optimizer's own ``step`` with only that parameter in
its groups (as :mod:`diffpipe_core.optim.offload` does, whose step it calls when both are on), then frees the
gradient. So a stage never holds more than the gradients backward is still producing, instead of a gradient the
size of its trained weights. What changes against a plain step:

* gradient accumulation is refused (``gradient_accumulation_steps`` must be 1): a parameter is stepped after one
  micro-batch's backward, there is nothing to accumulate into (kohya's and OneTrainer's fused backward pass have the
  same rule);
* ``gradient_clipping`` clips each parameter's gradient by its own norm: the global norm is only known once every
  update is done. The logged ``grad_norm`` is still the global pre-clip norm (summed as the hooks run);
* a non-finite gradient skips that parameter's update (and the step is logged as skipped), the parameters stepped
  before it in the same backward keep their update;
* one data-parallel replica per stage: the replicas' gradients would have to be averaged before each update.

DeepSpeed's pipeline engine still calls ``optimizer.step`` after the backward pass; :class:`GradientRelease` makes
that step a no-op (every parameter is already stepped) and the LR schedule steps as usual, so the next step's
updates use the next learning rate. A stage that is not the last runs its backward one output tensor at a time
(``retain_graph=True``), which would complete a parameter that feeds two outputs twice; with gradient release that
stage runs one backward over all its outputs (:func:`diffpipe_core.engine.ds_patches.single_backward`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


class GradientRelease:
    """Steps ``optimizer`` one parameter at a time from hooks on ``params``; see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], clip: float | None) -> None:
        self.optimizer, self.clip = optimizer, float(clip or 0.0)
        self.step_all: Callable[..., Any] = optimizer.step  # the optimizer's (or offload's) step, before any guard
        self.sq_norm: torch.Tensor | None = None  # this step's squared pre-clip norm, summed as hooks run
        self.nonfinite = False
        self.live_bytes = 0  # gradient bytes held right now by parameters the hooks have not stepped yet
        self.peak_bytes = 0  # the most ``live_bytes`` reached this step (a test's and the memory report's figure)
        self.stepped = 0  # parameters stepped this step
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in params]

    def start_step(self) -> None:
        """Forget the last step's norm and counts (the trainer calls it before each step)."""
        self.sq_norm, self.nonfinite, self.peak_bytes, self.stepped = None, False, 0, 0

    @torch.no_grad()
    def _ready(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            return
        size = grad.numel() * grad.element_size()
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        try:
            norm = torch.linalg.vector_norm(grad.float())
            sq = norm.square()
            self.sq_norm = sq if self.sq_norm is None else self.sq_norm + sq.to(self.sq_norm.device)
            if not math.isfinite(float(norm)):  # one sync per parameter: an update with a nan must not happen
                self.nonfinite = True
                return
            if self.clip:
                grad.mul_(torch.clamp(self.clip / (norm + 1e-6), max=1.0).to(grad.dtype))
            self._step_one(p)
            self.stepped += 1
        finally:
            p.grad = None
            self.live_bytes -= size

    def _step_one(self, p: torch.Tensor) -> None:
        groups = self.optimizer.param_groups
        members = [group["params"] for group in groups]
        try:
            for group, params in zip(groups, members, strict=True):
                group["params"] = [p] if any(q is p for q in params) else []
            self.step_all()
        finally:
            for group, params in zip(groups, members, strict=True):
                group["params"] = params

    def step_norm(self) -> torch.Tensor:
        """This rank's pre-clip gradient norm of the step (0 when no hook ran), for the global norm."""
        if self.sq_norm is None:
            return torch.zeros(())
        return torch.nan_to_num(self.sq_norm, nan=float("inf")).sqrt()

    def remove(self) -> None:
        """Take the hooks off (the parameters then train with plain steps again)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
