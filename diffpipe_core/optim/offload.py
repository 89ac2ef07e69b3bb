"""``[optimizer] offload = true``: the optimizer's state lives in host memory between steps.

Each step updates one parameter at a time: that parameter's state tensors are brought to its device, the optimizer's
own ``step`` runs with only that parameter in its groups, and the state goes back to host memory. So the device holds
the weights, their gradients and one parameter's optimizer state at a time, instead of the whole state (two moments
per weight for AdamW: twice the weights' bytes in float32). The cost is copying the state to the device and back
every step. Scalar state (step counters, scales) stays where the optimizer keeps it.

DeepSpeed's own ZeRO-Offload runs with its pipeline engine only under ZeRO stage 1, whose optimizer replaces the
client's: float32 master copies in flat partitioned buffers, its own checkpoint layout, its CPU Adam. diffpipe's
optimizers, gradient clipping and checkpoint files would not survive that, so diffpipe offloads the state of its own
optimizer instead, for any optimizer whose update of a parameter reads only that parameter's state
(``OFFLOADABLE_OPTIMIZERS`` in :mod:`diffpipe_core.optimizer_names`).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

HOST = torch.device("cpu")


def _move_state(state: dict[str, Any], device: torch.device) -> None:
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.device != device:
            state[key] = value.to(device)


def offload_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Keep ``optimizer``'s state in host memory between steps (see the module docstring); returns it. Call before
    an LR scheduler wraps its ``step``."""
    step_all = optimizer.step
    load = optimizer.load_state_dict

    def step(self: torch.optim.Optimizer, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        members = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = []
            for group, params in zip(self.param_groups, members, strict=True):
                for p in params:
                    if p.grad is None:
                        continue
                    if p in self.state:
                        _move_state(self.state[p], p.device)
                    group["params"] = [p]
                    step_all()
                    group["params"] = []
                    _move_state(self.state[p], HOST)
        finally:
            for group, params in zip(self.param_groups, members, strict=True):
                group["params"] = params
        return loss

    def load_state_dict(self: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        load(state_dict)  # torch puts each parameter's state on its device
        for state in self.state.values():
            _move_state(state, HOST)

    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)  # type: ignore[method-assign]
    return optimizer
