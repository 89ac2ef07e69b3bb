"""``automagic``: the optimizer ai-toolkit introduced and diffusion-pipe ships, written for diffpipe.

An Adafactor-like step (factored second moment for tensors of 2 or more dimensions, the update's RMS clipped to
``clip_threshold``) whose learning rate is learned per element: each element's rate grows by ``lr_bump`` when the
update keeps its sign from the last step and shrinks by ``lr_bump`` when it flips, within ``[min_lr, max_lr]``.
``lr`` is the rate every element starts at. Weight decay is decoupled and scaled by each element's rate. bf16/fp16
parameters are updated with Kahan compensation (a buffer of what rounding lost), so small steps still count.

The per-element rates are kept as int8 with one float32 scale per tensor (as ai-toolkit's ``Auto8bitTensor``), in
plain optimizer state tensors: ``state_dict`` / ``load_state_dict`` and diffpipe's checkpoints carry them as they
are, so a resumed run repeats the uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

MAX_START_LR = 1e-3  # ai-toolkit forces larger starting rates to 1e-6: "this does not work like prodigy"
FLOAT32_STATE = ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "lr_mask_scale")


class Automagic(torch.optim.Optimizer):
    """Automagic (see the module docstring). ``lr`` is the starting per-element rate; ``lr_bump`` the change per
    step; ``beta2`` the second moment's decay; ``eps`` added to the squared gradient."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-6,
        min_lr: float = 1e-7,
        max_lr: float = 1e-3,
        lr_bump: float = 1e-6,
        eps: float = 1e-30,
        clip_threshold: float = 1.0,
        beta2: float = 0.999,
        weight_decay: float = 0.0,
    ) -> None:
        if not 0 < lr <= MAX_START_LR:
            raise ValueError(
                f"optimizer.lr: automagic starts every element at lr and learns it from there; lr must be in "
                f"(0, {MAX_START_LR}] (typical: 1e-6), got {lr}"
            )
        if not 0 < min_lr <= max_lr:
            raise ValueError(f"optimizer.kwargs: automagic needs 0 < min_lr <= max_lr, got {min_lr}, {max_lr}")
        defaults = {
            "lr": lr, "min_lr": min_lr, "max_lr": max_lr, "lr_bump": lr_bump, "eps": eps,
            "clip_threshold": clip_threshold, "beta2": beta2, "weight_decay": weight_decay,
        }  # fmt: skip
        super().__init__(params, defaults)

    @staticmethod
    def _rms(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.norm(2) / (tensor.numel() ** 0.5)

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        _store_rates(state, torch.full(p.shape, group["lr"], dtype=torch.float32, device=p.device))
        state["last_polarity"] = torch.zeros(p.shape, dtype=torch.bool, device=p.device)
        if p.dim() >= 2:
            state["exp_avg_sq_row"] = torch.zeros(p.shape[:-1], dtype=torch.float32, device=p.device)
            state["exp_avg_sq_col"] = torch.zeros(p.shape[:-2] + p.shape[-1:], dtype=torch.float32, device=p.device)
        else:
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if p.dtype != torch.float32:
            state["kahan_compensation"] = torch.zeros_like(p)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta2 = group["beta2"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                state = self.state[p] if self.state[p] else self._init_state(p, group)
                state["step"] += 1
                update = grad.square().add_(group["eps"])
                if p.dim() >= 2:
                    row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
                    row.mul_(beta2).add_(update.mean(dim=-1), alpha=1 - beta2)
                    col.mul_(beta2).add_(update.mean(dim=-2), alpha=1 - beta2)
                    r = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
                    update = r.mul(col.unsqueeze(-2).rsqrt()).mul_(grad)
                else:
                    sq = state["exp_avg_sq"]
                    sq.mul_(beta2).add_(update, alpha=1 - beta2)
                    update = sq.rsqrt().mul_(grad)
                update.div_((self._rms(update) / group["clip_threshold"]).clamp_(min=1.0))
                polarity = update > 0
                agree = polarity == state["last_polarity"]
                state["last_polarity"] = polarity
                rates = _read_rates(state)
                rates = torch.where(agree, rates + group["lr_bump"], rates - group["lr_bump"])
                rates.clamp_(min=group["min_lr"], max=group["max_lr"])
                _store_rates(state, rates)
                weight = p.float()
                if "kahan_compensation" in state:
                    weight.add_(state["kahan_compensation"].float())
                change = update.mul_(rates).neg_()
                if group["weight_decay"]:
                    change.sub_(weight * rates * group["weight_decay"])
                weight.add_(change)
                if "kahan_compensation" in state:
                    p.copy_(weight)
                    state["kahan_compensation"].copy_(weight.sub_(p.float()))
                else:
                    p.copy_(weight)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, then the float32 state put back in float32 (torch casts a bf16 parameter's state to bf16)."""
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(ids, params, strict=True):
            for key in FLOAT32_STATE:
                if key in saved.get(i, {}):
                    self.state[p][key] = saved[i][key].to(device=p.device, dtype=torch.float32)


def _store_rates(state: dict[str, Any], rates: torch.Tensor) -> None:
    """The per-element rates as int8 and one float32 scale (ai-toolkit's 8-bit rate mask)."""
    scale = rates.abs().max().clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    state["lr_mask"] = (rates / scale).round_().clamp_(-127, 127).to(torch.int8)
    state["lr_mask_scale"] = scale.reshape(())


def _read_rates(state: dict[str, Any]) -> torch.Tensor:
    return state["lr_mask"].float() * state["lr_mask_scale"]
