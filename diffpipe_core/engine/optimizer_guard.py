"""The optimizer step every rank takes together: clip by the global gradient norm, or skip on a non-finite one.

Clipping here rather than in DeepSpeed gives the pre-clip norm to log, and skipping on every rank when any rank
has a non-finite gradient keeps a bad batch away from the weights and the optimizer state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from diffpipe_core.engine.grad_norm import clip_grads_, global_grad_norm
from diffpipe_core.optim.gradient_release import GradientRelease


class OptimizerGuard:
    """Wraps ``optimizer.step`` in place; after each step ``grad_norm`` holds the pre-clip global norm and
    ``nonfinite`` whether the step was skipped."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], clip: float, dp: int, device: torch.device
    ) -> None:
        self.optimizer, self.params, self.clip, self.dp, self.device = optimizer, params, clip, dp, device
        self.grad_norm: float | None = None
        self.nonfinite = False
        self.first_step_check: Callable[[], None] | None = None  # called once, before the first step
        self.release: GradientRelease | None = None  # [optimizer] gradient_release: the hooks stepped already
        original = optimizer.step

        def guarded_step(*args: Any, **kwargs: Any) -> Any:
            if self.release is not None:  # every parameter was stepped as its gradient was ready
                self.grad_norm = global_grad_norm([self.release.step_norm()], self.dp, self.device)
                self.nonfinite = self.release.nonfinite or not math.isfinite(self.grad_norm)
                return original(*args, **kwargs)  # no gradient is left: only the LR schedule's bookkeeping
            if self.first_step_check is not None:
                check, self.first_step_check = self.first_step_check, None
                check()
            grads = [p.grad for p in self.params if p.grad is not None]
            self.grad_norm = global_grad_norm(grads, self.dp, self.device)
            if not math.isfinite(self.grad_norm):
                self.nonfinite = True
                self.optimizer.zero_grad(set_to_none=True)
                return None
            clip_grads_(grads, self.clip, self.grad_norm)
            return original(*args, **kwargs)

        optimizer.step = guarded_step  # type: ignore[method-assign]

    def start_step(self) -> None:
        self.nonfinite = False
        if self.release is not None:
            self.release.start_step()
