"""CFG-augmented training (``[model] cfg = N``) of a guidance-distilled model, for any model plugin.

A guidance-distilled model's output stands for the guided prediction ``u + N * (c - u)`` of a model whose
conditional and unconditional predictions are ``c`` and ``u``. Training its output straight toward the data's
target would teach it the unguided prediction and lose the distilled guidance. So each step first runs the same
micro-batches (same noise, same timesteps) with the empty prompt through the pipeline, forward only and without
gradient (:func:`~diffpipe_core.engine.ds_patches.forward_outputs`), and the loss compares
``(output + (N - 1) * u) / N`` (the conditional prediction the guided output implies) with the target, as the
anchor's MiniMax H3 model does. Equivalently the output is trained toward ``N * target - (N - 1) * u`` with the
loss scaled by ``1 / N**2``. ``u`` is the model's own current prediction (adapter included), so it costs one
forward per micro-batch and no backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from diffpipe_core.engine.ds_patches import forward_outputs
from diffpipe_core.engine.micro_batches import MicroBatches


def fold_uncond(outputs: Any, uncond: Any, cfg: float) -> Any:
    """``(outputs + (cfg - 1) * uncond) / cfg`` for each float tensor of ``outputs`` (a tensor or a tuple/list,
    ``uncond`` the same shape), ``uncond`` without gradient; other items as they are."""
    if torch.is_tensor(outputs):
        if not outputs.is_floating_point():
            return outputs
        return (outputs + (cfg - 1.0) * uncond.detach().to(outputs.dtype)) / cfg
    folded = [fold_uncond(o, u, cfg) for o, u in zip(outputs, uncond, strict=True)]
    return type(outputs)(folded) if isinstance(outputs, tuple) else folded


Drawn = list[tuple[list[int], int]]  # a step's micro-batches: (sample indices, micro-batch number) each


def draw(batches: MicroBatches, count: int) -> Drawn:
    """Draw the step's ``count`` micro-batches ahead of the training pass, for the passes without gradient that
    run them first (this one, and the regularisation base pass of :mod:`diffpipe_core.engine.regularization`) and
    for :func:`replay`."""
    return [batches.draw() for _ in range(count)]


def pass_without_gradient(
    engine: Any, batches: MicroBatches, drawn: Drawn, uncond: bool = False, class_prompt: bool = False
) -> Any:
    """Run the ``drawn`` micro-batches (with the empty prompt if ``uncond``, the class prompts if ``class_prompt``)
    through the pipeline, forward only and without gradient: the last stage's outputs per micro-batch (None
    elsewhere). The same noise and timesteps as their training pass (:meth:`MicroBatches.make` is seeded by the
    micro-batch's number)."""
    made = (batches.make(indices, m, uncond=uncond, class_prompt=class_prompt) for indices, m in drawn)
    return forward_outputs(engine, made, len(drawn))


def uncond_pass(engine: Any, batches: MicroBatches, count: int, drawn: Drawn | None = None) -> tuple[Drawn, Any]:
    """Draw the step's ``count`` micro-batches (unless ``drawn`` already) and run them with the empty prompt through
    the pipeline, forward only: ``(drawn, outputs)``, ``drawn`` for :func:`replay` and ``outputs`` the last stage's per
    micro-batch (None elsewhere)."""
    drawn = draw(batches, count) if drawn is None else drawn
    return drawn, pass_without_gradient(engine, batches, drawn, uncond=True)


def replay(
    batches: MicroBatches, drawn: Drawn, make: Callable[[list[int], int], Any] | None = None
) -> Iterator[Any]:
    """The micro-batches :func:`uncond_pass` drew, with their captions, for the training pass (made by ``make``
    when given: :func:`diffpipe_core.engine.regularization.training_batch`)."""
    for indices, m in drawn:
        batches.step_ids.extend(batches.dataset.sample_ids(indices))
        yield (make or batches.make)(indices, m)
