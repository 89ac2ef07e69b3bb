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

from collections.abc import Iterator
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


def uncond_pass(engine: Any, batches: MicroBatches, count: int) -> tuple[list[tuple[list[int], int]], Any]:
    """Draw the step's ``count`` micro-batches and run them with the empty prompt through the pipeline, forward only:
    ``(drawn, outputs)``, ``drawn`` for :func:`replay` and ``outputs`` the last stage's per micro-batch (None
    elsewhere)."""
    drawn = [batches.draw() for _ in range(count)]
    empty = (batches.make(indices, m, uncond=True) for indices, m in drawn)
    return drawn, forward_outputs(engine, empty, count)


def replay(batches: MicroBatches, drawn: list[tuple[list[int], int]]) -> Iterator[Any]:
    """The micro-batches :func:`uncond_pass` drew, with their captions, for the training pass."""
    for indices, m in drawn:
        batches.step_ids.extend(batches.dataset.sample_ids(indices))
        yield batches.make(indices, m)
