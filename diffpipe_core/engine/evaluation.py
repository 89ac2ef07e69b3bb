"""Held-out loss of the eval datasets at fixed timestep quantiles (no dropout, no update)."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from diffpipe_core.config import ResolvedConfig
from diffpipe_core.engine.micro_batches import MicroBatches
from diffpipe_core.engine.stage_build import Layout
from diffpipe_core.registry import ModelPlugin
from diffpipe_core.types import TrainingContext

EVAL_QUANTILES = (0.1, 0.3, 0.5, 0.7, 0.9)


def evaluate(
    engine: Any,
    eval_datasets: dict[str, Any],
    cfg: ResolvedConfig,
    plugin: ModelPlugin,
    layout: Layout,
    step: int,
    writer: Any,
    loss: Any = None,
) -> dict[str, float]:
    """Every eval micro-batch of this rank's share goes through the pipeline once per quantile, with noise seeded
    by its position, so eval losses are comparable across steps and runs. Logged under ``eval/`` on rank 0.

    ``loss`` (the stage's :class:`~diffpipe_core.engine.stage_build.LossFunction`) sees each quantile's context
    while it runs, and the training context again after."""
    from diffpipe_core.data import BucketSampler
    from diffpipe_core.engine.micro_batches import bucket_sizes

    run = cfg.run
    results: dict[str, float] = {}
    training_context = loss.context if loss is not None else None
    try:
        for name, dataset in eval_datasets.items():
            per_quantile = []
            groups = dataset.groups()
            for q in EVAL_QUANTILES:
                sampler = BucketSampler(groups, bucket_sizes(run, dataset, groups), layout.dp_rank, layout.dp, 0)
                if len(sampler) == 0:
                    break
                context = TrainingContext(model_config=cfg.model, step=step, eval_quantile=q, loss=run.loss)
                if loss is not None:
                    loss.context = context
                batches = MicroBatches(dataset, sampler, plugin, context, run.seed + 1, layout.dp_rank, 0, layout.dp)
                value = float(engine.eval_batch(iter(batches), num_micro_batches=len(sampler)))
                per_quantile.append(value)
                results[f"{name}/t_q{q:.1f}"] = value
            if per_quantile:
                results[f"{name}/loss"] = sum(per_quantile) / len(per_quantile)
    finally:
        if loss is not None:
            loss.context = training_context
    if writer is not None:
        for key, value in results.items():
            writer.add_scalar(f"eval/{key}", value, step)
    if layout.rank == 0 and results:
        means = ", ".join(f"{k.split('/')[0]} {v:.4f}" for k, v in results.items() if k.endswith("/loss"))
        tqdm.write(f"diffpipe: step {step} eval loss: {means}")
    return results
