"""Regularisation (prior) folders and per-folder loss weights in the training loss.

A ``[[directory]]`` with ``regularization = true`` holds items that keep the model near what it did before training.
``regularization_target = "captions"`` (the default) trains them like any item, toward their captions' ordinary
target, weighted by the folder's ``loss_weight`` (kohya's ``is_reg`` with ``prior_loss_weight``).
``regularization_target = "base"`` trains them toward the frozen base model's own prediction for the same noisy
latent, timestep and caption: before the training pass, the step's micro-batches that hold such items run through
the pipeline once more, forward only and without gradient, with the adapter disabled (a full fine-tune: with its
initial weights swapped in from host memory) -- the same pass without gradient that CFG-augmented training runs
(:func:`diffpipe_core.engine.cfg_training.pass_without_gradient`). Such an item's loss is the run's elementwise loss
(``training_loss``: MSE unless run.toml sets another) between the model's prediction (its first output) and the base
model's, over the whole prediction; other items keep the plugin's ``compute_loss``.

A micro-batch's loss is the mean over its samples of ``loss_weight`` times the sample's loss: when its samples share
one weight and none trains toward the base, that is the plugin's loss times the weight (exactly the plugin's loss at
weight 1, so datasets without these keys train as before); otherwise the samples are grouped (same weight, same
target) and each group's loss, from the plugin on the group's slice of the micro-batch, counts by its share of samples.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from diffpipe_core.diffusion import training_loss
from diffpipe_core.engine.cfg_training import Drawn, pass_without_gradient
from diffpipe_core.engine.ema import swap_
from diffpipe_core.engine.micro_batches import MicroBatches


@dataclass
class MicroRoles:
    """One micro-batch's samples: their loss weights and which train toward the base model's prediction, and (on the
    last stage, after :func:`base_pass`) the base model's outputs for it."""

    weights: list[float]
    base: list[bool]
    base_outputs: Any = None
    dop: list[bool] | None = None  # diff_output_preservation: samples with a class prompt
    dop_multiplier: float = 1.0
    dop_outputs: Any = None  # the base model's outputs for the class prompts (last stage, after dop_pass)

    @property
    def plain(self) -> bool:
        """One weight for every sample, none toward the base, no class prompt: the plugin's loss times that weight."""
        return not any(self.base) and len(set(self.weights)) <= 1 and not self.any_dop

    @property
    def any_dop(self) -> bool:
        return bool(self.dop) and any(self.dop)


def step_roles(dataset: Any, drawn: Drawn) -> list[MicroRoles]:
    """The roles of the step's drawn micro-batches (``dataset.sample_roles``, ``sample_dop``)."""
    multiplier = getattr(dataset.roles, "dop_multiplier", 1.0)
    return [MicroRoles(*dataset.sample_roles(indices), dop=dataset.sample_dop(indices), dop_multiplier=multiplier)
            for indices, _ in drawn]


def needs_roles(dataset: Any) -> bool:
    """Whether ``dataset`` has a folder with a loss weight other than 1, one trained toward the base, or class
    prompts (``diff_output_preservation``)."""
    roles = getattr(dataset, "roles", None)
    return roles is not None and (roles.weighted or roles.any_base)


def needs_base(dataset: Any) -> bool:
    """Whether a step may need the base model's outputs: a folder toward the base, or class prompts."""
    roles = getattr(dataset, "roles", None)
    return roles is not None and (roles.any_base or roles.any_dop)


class FrozenBase:
    """What the base model is for this stage: the adapter disabled, or (a full fine-tune) the initial trained
    tensors, kept in host memory and swapped in for the pass."""

    def __init__(self, model: nn.Module, trainable: dict[str, torch.Tensor], adapter: bool) -> None:
        self.adapters = [m for m in model.modules() if isinstance(m, BaseTunerLayer)] if adapter else []
        self.trainable = trainable
        self.initial = None if adapter else {n: p.detach().to("cpu", copy=True) for n, p in trainable.items()}

    @property
    def host_bytes(self) -> int:
        """Host memory the initial weights take (0 for an adapter)."""
        return sum(t.numel() * t.element_size() for t in (self.initial or {}).values())

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside the block the stage computes the base model's outputs."""
        if self.initial is not None:
            swap_(self.trainable, self.initial)
            try:
                yield
            finally:
                swap_(self.trainable, self.initial)
            return
        was = [m._disable_adapters for m in self.adapters]
        for m in self.adapters:
            m._disable_adapters = True  # peft's disable_adapters flag, without its requires_grad changes
        try:
            yield
        finally:
            for m, flag in zip(self.adapters, was, strict=True):
                m._disable_adapters = flag


def base_pass(engine: Any, batches: MicroBatches, drawn: Drawn, roles: list[MicroRoles], base: FrozenBase) -> None:
    """Run the micro-batches of ``drawn`` holding an item trained toward the base through the base model, forward
    only and without gradient, and keep the last stage's outputs in their :class:`MicroRoles`. Every stage of the
    pipeline draws the same micro-batches, so they agree on which to run."""
    picks = [k for k, r in enumerate(roles) if any(r.base)]
    if not picks:
        return
    with base.active():
        outputs = pass_without_gradient(engine, batches, [drawn[k] for k in picks])
    if outputs is not None:
        for k, out in zip(picks, outputs, strict=True):
            roles[k].base_outputs = out


def dop_pass(engine: Any, batches: MicroBatches, drawn: Drawn, roles: list[MicroRoles], base: FrozenBase) -> None:
    """Differential Output Preservation: run the micro-batches of ``drawn`` holding an item with a class prompt
    through the base model on their class prompts (same noise and timesteps), forward only and without gradient, and
    keep the last stage's outputs in their :class:`MicroRoles` (the targets of the trained model's class-prompt
    predictions)."""
    picks = [k for k, r in enumerate(roles) if r.any_dop]
    if not picks:
        return
    with base.active():
        outputs = pass_without_gradient(engine, batches, [drawn[k] for k in picks], class_prompt=True)
    if outputs is not None:
        for k, out in zip(picks, outputs, strict=True):
            roles[k].dop_outputs = out


def concat_batches(first: Any, second: Any, batch: int) -> Any:
    """Two prepared micro-batches of ``batch`` samples as one of ``2 * batch``: every tensor whose first dimension is
    ``batch`` concatenated, the others (equal in both) taken once."""
    if torch.is_tensor(first):
        if first.dim() > 0 and first.shape[0] == batch:
            if first.shape[1:] != second.shape[1:]:
                raise ValueError(
                    f"diff_output_preservation: a class prompt's input has shape {tuple(second.shape)} where its "
                    f"caption's has {tuple(first.shape)}; this model's inputs for two prompts cannot share a "
                    "micro-batch (its text is not padded to one length), so it cannot use diff_output_preservation"
                )
            return torch.cat([first, second])
        return first
    if isinstance(first, (tuple, list)):
        out = [concat_batches(a, b, batch) for a, b in zip(first, second, strict=True)]
        return tuple(out) if isinstance(first, tuple) else out
    return first


def training_batch(batches: MicroBatches, roles: list[MicroRoles]) -> Callable[[list[int], int], Any]:
    """What :func:`~diffpipe_core.engine.cfg_training.replay` makes for the step's ``k``-th micro-batch: with class
    prompts, the micro-batch on its captions followed by the same samples (same noise and timesteps) on their class
    prompts, one micro-batch of twice the samples; otherwise the micro-batch as it is."""
    order = iter(list(roles))  # the loss function pops from the list itself

    def make(indices: list[int], m: int) -> Any:
        role = next(order)
        plain = batches.make(indices, m)
        if not role.any_dop:
            return plain
        return concat_batches(plain, batches.make(indices, m, class_prompt=True), len(indices))

    return make


def _prediction(outputs: Any) -> torch.Tensor:
    return outputs if torch.is_tensor(outputs) else next(t for t in outputs if torch.is_tensor(t))


def take(tensors: Any, index: torch.Tensor, batch: int) -> Any:
    """The samples ``index`` of every tensor of ``tensors`` (a tensor or nested tuple/list) whose first dimension is
    the micro-batch's ``batch``; other items as they are."""
    if torch.is_tensor(tensors):
        return tensors[index.to(tensors.device)] if tensors.dim() > 0 and tensors.shape[0] == batch else tensors
    if isinstance(tensors, (tuple, list)):
        out = [take(t, index, batch) for t in tensors]
        return tuple(out) if isinstance(tensors, tuple) else out
    return tensors


def weighted_loss(
    role: MicroRoles, outputs: Any, raw_outputs: Any, targets: Any, plugin_loss: Callable[[Any, Any], torch.Tensor],
    context: Any,
) -> torch.Tensor:
    """The micro-batch's loss (see the module docstring): ``outputs`` as the plugin's loss takes them (CFG-folded
    where ``[model] cfg`` is on), ``raw_outputs`` the model's own (compared with the base model's)."""
    n = len(role.weights)
    if role.any_dop:  # the first n samples on their captions, the next n on their class prompts
        first, second = torch.arange(n), torch.arange(n, 2 * n)
        class_pred = take(_prediction(raw_outputs), second, 2 * n)
        outputs, raw_outputs, targets = (take(x, first, 2 * n) for x in (outputs, raw_outputs, targets))
        main = MicroRoles(role.weights, role.base, role.base_outputs)
        loss = weighted_loss(main, outputs, raw_outputs, targets, plugin_loss, context)
        if role.dop_outputs is None:
            raise RuntimeError("diff_output_preservation: no base model outputs for the class prompts")
        index = torch.tensor([i for i, d in enumerate(role.dop or ()) if d])
        pred = class_pred[index.to(class_pred.device)]
        ref = take(_prediction(role.dop_outputs), index, n).detach().to(pred.device, pred.dtype)
        return loss + training_loss(pred, ref, None, context) * (role.dop_multiplier * len(index) / n)
    if role.plain:
        loss = plugin_loss(outputs, targets)
        return loss if role.weights[0] == 1.0 else loss * role.weights[0]
    groups: dict[tuple[float, bool], list[int]] = {}
    for i, (w, b) in enumerate(zip(role.weights, role.base, strict=True)):
        groups.setdefault((w, b), []).append(i)
    total = None
    for (w, toward_base), members in groups.items():
        index = torch.tensor(members)
        if toward_base:
            if role.base_outputs is None:
                raise RuntimeError("regularisation: no base model outputs for a micro-batch with base-target items")
            pred = take(_prediction(raw_outputs), index, n)
            ref = take(_prediction(role.base_outputs), index, n).detach().to(pred.device, pred.dtype)
            part = training_loss(pred, ref, None, context)
        else:
            part = plugin_loss(take(outputs, index, n), take(targets, index, n))
        part = part * (w * len(members) / n)
        total = part if total is None else total + part
    assert total is not None
    return total
