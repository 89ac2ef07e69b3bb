"""Making a run's stage plan: the model's layers, their costs and (when the dataset is cached) the first layer's
inputs for one micro-batch of the largest bucket. Used by the workers before loading a stage, and by
``diffpipe validate`` / ``diffpipe data`` (which build the model on the meta device only: no weights are read)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from diffpipe_core.config import ResolvedConfig
from diffpipe_core.engine.activations import LayerTensors
from diffpipe_core.engine.stage_costs import ModelCosts, layer_costs, weights_only_costs
from diffpipe_core.engine.stage_plan import StagePlan, plan_stages
from diffpipe_core.registry import ModelPlugin
from diffpipe_core.types import TrainingContext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _float_bytes(batch: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values() if torch.is_tensor(t) and t.is_floating_point())


def example_inputs(dataset: Any, plugin: ModelPlugin, cfg: ResolvedConfig) -> tuple[tuple[torch.Tensor, ...], str]:
    """The first layer's inputs for one micro-batch (that bucket's ``micro_batch_size_per_gpu`` samples) of the
    dataset's largest bucket (the most cached bytes per sample), made by the plugin's ``prepare_inputs``, and a
    label for it."""
    groups = [g for g in dataset.groups() if g]
    if not groups:
        raise ValueError("the cached dataset is empty")
    one = [_float_bytes(dataset.collate(g[:1], torch.Generator().manual_seed(0))) for g in groups]
    group = groups[max(range(len(groups)), key=lambda k: one[k])]
    bucket = dataset.bucket_of(group[0])
    size = cfg.run.micro_batch_size_for(bucket.width, bucket.height, bucket.frames)
    indices = (group * -(-size // len(group)))[:size]
    generator = torch.Generator().manual_seed(cfg.run.seed)
    batch = dataset.collate(indices, generator)
    inputs, _ = plugin.require(
        "prepare_inputs", batch=batch, context=TrainingContext(model_config=cfg.model), generator=generator
    )
    return tuple(inputs), f"micro-batch of {size} in bucket {bucket}"


def make_plan(
    cfg: ResolvedConfig,
    plugin: ModelPlugin,
    model: nn.Module,
    layers: list[nn.Module],
    dataset: Any = None,
    on_gpu: bool | None = None,
    forward_only: bool = False,
) -> StagePlan:
    """The stage plan of this run for ``model`` cut into ``layers`` (any device; left unchanged). Activations are
    estimated when ``dataset`` (a cached dataset) is given; ``forward_only`` (sampling) keeps none for backward."""
    inputs, label = None, "not estimated: the dataset is not cached yet (diffpipe cache)"
    if forward_only:
        label = "none kept (sampling runs forward only)"
    try:
        if dataset is not None and not forward_only:
            inputs, label = example_inputs(dataset, plugin, cfg)
        costs = layer_costs(cfg, plugin, model, layers, inputs)
    except Exception as exc:  # the plan must never stop a run the old partitioner could do: weights only, then
        costs = weights_only_costs(layers)
        label = f"not estimated, nor trainable state ({type(exc).__name__}: {str(exc)[:160]})"
    if costs.failed:
        label += f"; layers from {costs.failed.split(':')[0]} on borrow a like layer's figures (meta forward failed)"
    ways = cfg.run.sequence_parallel
    if ways > 1:
        costs = sequence_split_costs(costs, ways)
        label += f"; per rank of {ways} sequence ranks, the blocks' tokens split {ways} ways" if inputs else ""
    gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    roles = getattr(dataset, "roles", None)
    toward_base = roles is not None and roles.any_base and not forward_only
    dop = roles is not None and getattr(roles, "any_dop", False) and not forward_only
    passes = int(getattr(cfg.model, "cfg", None) is not None and not forward_only) + int(toward_base) + int(dop)
    # a CPU run's workers hold glibc's heap overhead beside the tensors, unless its mmap threshold is fixed
    heap = not gpu and "MALLOC_MMAP_THRESHOLD_" not in os.environ
    return plan_stages(costs, cfg.run, cfg.run.pipeline_stages, gpu, label, passes,
                       (toward_base or dop) and cfg.run.adapter is None, 2 if dop else 1, heap)


def sequence_split_costs(costs: ModelCosts, ways: int) -> ModelCosts:
    """``costs`` per sequence rank of ``sequence_parallel = ways``: the block layers (``LayerCost.block``) keep,
    take in and send on ``1/ways`` of their tensors (their tokens are split; the all-to-all'd attention holds the
    whole sequence over ``heads / ways`` heads, the same share). The other layers run on the whole sequence."""
    def split(tensors: LayerTensors) -> LayerTensors:
        return LayerTensors(*({k: -(-v // ways) for k, v in part.items()}
                              for part in (tensors.saved, tensors.inputs, tensors.outputs)), measured=tensors.measured)

    layers = [replace(c, tensors=split(c.tensors)) if c.block else c for c in costs.layers]
    return ModelCosts(layers, costs.measured, costs.failed)


def unconditional_line(plan: StagePlan, cfg: ResolvedConfig, plugin: ModelPlugin) -> str | None:
    """With ``[sample] cfg > 1`` for a model declaring ``unconditional_model``: the plan's line for it, on the last
    stage while sampling (its weights beside the stage's weights and trained state; the stages are cut without it);
    None otherwise."""
    from diffpipe_core.engine.stage_plan import _mib
    from diffpipe_core.sampling.unconditional import runs_unconditional, unconditional_bytes

    sample = cfg.run.sample
    if sample is None or not runs_unconditional(plugin, sample.cfg):
        return None
    what = f"  sampling (cfg {sample.cfg:g}): stage {len(plan.stages) - 1} also holds {plugin.spec.unconditional_model}"
    try:
        size = unconditional_bytes(plugin, cfg.model)
    except Exception as exc:  # a plan never stops a run: say what is not counted
        return f"{what}, not counted ({type(exc).__name__}: {str(exc)[:120]})"
    last = plan.stages[-1]
    peak = last.weight_bytes + last.state_bytes + size
    return f"{what}, +{_mib(size)} while sampling (host memory otherwise): {_mib(peak)} with its weights and state"


def plan_for_config(cfg: ResolvedConfig, plugin: ModelPlugin) -> StagePlan:
    """The plan ``diffpipe train`` would make, without reading weights: the model is built on the meta device and
    the cached dataset, if there is one, read for shapes. Raises ValueError when the plugin cannot build its model
    on the meta device."""
    from diffpipe_core.data.cache import open_cached

    try:
        model = plugin.require(
            "load_diffusion_model", model_config=cfg.model, device=torch.device("meta"), dtype=DTYPES[cfg.model.dtype]
        )
        layers = list(plugin.require("split_into_layers", model=model, model_config=cfg.model))
    except Exception as exc:
        raise ValueError(f"model plugin {plugin.name!r} cannot build its model on the meta device: {exc}") from None
    return make_plan(cfg, plugin, model, layers, open_cached(cfg.run.dataset, plugin, cfg.model))


def plan_report(cfg: ResolvedConfig, plugin: ModelPlugin) -> list[str]:
    """:func:`plan_for_config` formatted for ``diffpipe validate`` / ``data``, or one line saying why there is none."""
    from diffpipe_core.engine.stage_plan import format_plan

    try:
        plan = plan_for_config(cfg, plugin)
        return [*format_plan(plan), *filter(None, [unconditional_line(plan, cfg, plugin)])]
    except ValueError as exc:
        return [f"stage plan: not available: {exc}"]
