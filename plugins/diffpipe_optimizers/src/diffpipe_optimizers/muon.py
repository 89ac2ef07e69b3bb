"""``muon``: torch's own ``torch.optim.Muon`` for the 2-D weights, AdamW for every other parameter, as one optimizer.

DeepSpeed, the LR schedule and diffpipe's checkpoints see one ``torch.optim.Optimizer``: each of its parameter groups
is split in two (``muon = True``: the 2-D weights; ``muon = False``: biases, norms, embeddings of other shapes), and
the two inner optimizers step their own groups. Both share this optimizer's ``state`` and group dicts, so a learning
rate the schedule sets reaches them, and ``state_dict`` / ``load_state_dict`` are torch's, for both at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

# Muon's own keywords (torch.optim.Muon); every other keyword is AdamW's
MUON_KEYS = ("momentum", "nesterov", "ns_coefficients", "ns_steps", "adjust_lr_fn")


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on 2-D parameters, AdamW on the rest. ``adjust_lr_fn`` defaults to ``"match_rms_adamw"`` (Muon's update
    scaled to AdamW's RMS), so one ``lr`` suits both halves; ``"original"`` is Muon's paper scaling (then give Muon
    its own larger rate with group_lr). ``betas`` and ``eps`` are AdamW's; ``weight_decay`` applies to both."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.01,
        eps: float = 1e-8,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
    ) -> None:
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        split = []
        for group in groups:
            members = list(group["params"])
            for muon in (True, False):
                own = [p for p in members if (p.ndim == 2) == muon]
                if own:
                    split.append({**group, "params": own, "muon": muon})
        self._muon_kwargs = {"momentum": momentum, "nesterov": nesterov, "ns_coefficients": tuple(ns_coefficients),
                             "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn}
        self._adamw_kwargs = {"betas": tuple(betas), "eps": eps}
        super().__init__(split, {"lr": lr, "weight_decay": weight_decay})
        self._link(build=True)

    def _link(self, build: bool = False) -> None:
        """Point the inner optimizers at this one's group dicts and state (after building or loading)."""
        if build:
            muon = [g for g in self.param_groups if g["muon"]]
            rest = [g for g in self.param_groups if not g["muon"]]
            # built over this optimizer's own group dicts: their defaults are filled into them
            self._inner = [torch.optim.Muon(muon, **self._muon_kwargs)] if muon else []
            self._inner += [torch.optim.AdamW(rest, **self._adamw_kwargs)] if rest else []
        for inner in self._inner:
            is_muon = isinstance(inner, torch.optim.Muon)
            inner.param_groups = [g for g in self.param_groups if g["muon"] == is_muon]
            inner.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in self._inner:
            inner.step()
        return loss
