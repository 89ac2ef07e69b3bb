"""Build this rank's pipeline stage: load and partition the model, fill in the stage's weights, quantize,
apply the adapter, wrap the memory savers, and hand it all to DeepSpeed with the optimizer and LR schedule."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
from peft import PeftConfig
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from diffpipe_core.adapter_kinds import (
    STRENGTH_TENSORS,
    config_from_saved,
    from_adapter_table,
    is_adapter_param,
    kind_of,
    unfold_factor,
)
from diffpipe_core.adapters import excluding, read_adapter
from diffpipe_core.config import ResolvedConfig
from diffpipe_core.engine.adapter_layers import adapt_layers, lora_without_gradient
from diffpipe_core.engine.ds_patches import (
    ExplicitPartitionPipelineModule,
    keep_compiled_backward_buffers,
    keep_idle_groups_gradless,
    lean_step,
    name_gradless_boundary_tensors,
    release_forward_inputs,
    release_freed_before_instructions,
    single_backward,
    skip_single_replica_allreduce,
    wrap_stage_boundaries,
)
from diffpipe_core.engine.ema import EmaWeights
from diffpipe_core.engine.layer_rng import LayerSeeds, seed_stage_layers
from diffpipe_core.engine.model_loading import load_for_stages, materialise_layers
from diffpipe_core.engine.optimizer_guard import OptimizerGuard
from diffpipe_core.engine.plan_build import make_plan, unconditional_line
from diffpipe_core.engine.regularization import FrozenBase, needs_base
from diffpipe_core.engine.stage_plan import StagePlan, format_plan
from diffpipe_core.engine.zero import ds_config as zero_config
from diffpipe_core.memory import stage_blocks, swapped_blocks, wrap_stage_layers
from diffpipe_core.merge_adapters import merge_into, native_targets
from diffpipe_core.optim import (
    build_optimizer,
    forced_lr,
    freeze_zero_lr_groups,
    parameter_groups,
    plugin_groups,
    run_lr_lambda,
)
from diffpipe_core.optim.gradient_release import GradientRelease
from diffpipe_core.optim.offload import offload_state
from diffpipe_core.quantize import load_quantized, quantize_stage
from diffpipe_core.quiet import library_prints
from diffpipe_core.registry import ModelPlugin
from diffpipe_core.types import TrainingContext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: pipeline stage ``stage_id`` of ``stages``, data-parallel replica ``dp_rank`` of ``dp``,
    sequence rank ``seq_rank`` of ``seq`` (``sequence_parallel``). Ranks run ``(stage, replica, sequence rank)``,
    the last fastest; DeepSpeed's ``data`` axis is ``replica``: the ``dp x seq`` ranks of a stage."""

    rank: int
    world: int
    stages: int
    seq: int = 1

    @property
    def replicas(self) -> int:
        """The ranks holding one stage's layers (DeepSpeed's data-parallel group: ``dp x seq``)."""
        return self.world // self.stages

    @property
    def replica(self) -> int:
        """This rank's place among :attr:`replicas`."""
        return self.rank % self.replicas

    @property
    def dp(self) -> int:
        return self.replicas // self.seq

    @property
    def stage_id(self) -> int:
        return self.rank // self.replicas

    @property
    def dp_rank(self) -> int:
        return self.replica // self.seq

    @property
    def seq_rank(self) -> int:
        return self.rank % self.seq


class LossFunction:
    """The pipeline's ``loss_fn``: the model plugin's ``compute_loss`` with the context of the micro-batches in
    flight (the trainer's, or an eval quantile's while evaluating)."""

    def __init__(self, plugin: ModelPlugin, context: TrainingContext) -> None:
        self.plugin, self.context = plugin, context
        self.uncond: list[Any] | None = None  # [model] cfg: this step's unconditional outputs, one per micro-batch
        self.roles: list[Any] | None = None  # regularisation, loss weights: this step's MicroRoles per micro-batch

    def __call__(self, outputs: Any, targets: Any) -> Any:
        raw = outputs
        if self.uncond:
            from diffpipe_core.engine.cfg_training import fold_uncond

            outputs = fold_uncond(outputs, self.uncond.pop(0), self.context.model_config.cfg)
        if self.roles:
            from diffpipe_core.engine.regularization import weighted_loss

            return weighted_loss(self.roles.pop(0), outputs, raw, targets, self._plugin_loss, self.context)
        return self._plugin_loss(outputs, targets)

    def _plugin_loss(self, outputs: Any, targets: Any) -> Any:
        return self.plugin.require("compute_loss", outputs=outputs, targets=targets, context=self.context)


@dataclass
class Stage:
    """What :func:`build_stage` made for this rank."""

    model: nn.Module
    layer_names: list[str]
    parts: list[int]
    lora: PeftConfig | None  # the adapter's peft config (LoRA, LoKr or LoHa); None for a full fine-tune
    trainable: dict[str, torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    guard: OptimizerGuard
    engine: Any
    loss: LossFunction
    plan: StagePlan | None = None
    seeds: LayerSeeds | None = None  # the layers' random streams (:mod:`diffpipe_core.engine.layer_rng`)
    ema: EmaWeights | None = None  # [ema]: the average of ``trainable``
    base: FrozenBase | None = None  # regularization_target = "base": how this stage computes the base model
    zero: Any = None  # zero_stage = 1: DeepSpeed's ZeRO optimizer around ``optimizer`` (:mod:`.zero`)


@dataclass
class StageModule:
    """This rank's stage before DeepSpeed: the (adapted) model, its pipeline layers and the PipelineModule."""

    model: nn.Module
    layer_names: list[str]
    parts: list[int]
    own: range
    lora: PeftConfig | None  # the adapter's peft config (LoRA, LoKr or LoHa); None for a full fine-tune
    module: ExplicitPartitionPipelineModule
    loss: LossFunction
    plan: StagePlan
    seeds: LayerSeeds


def build_stage_module(
    cfg: ResolvedConfig,
    plugin: ModelPlugin,
    layout: Layout,
    device: torch.device,
    trainable: bool = True,
    dataset: Any = None,
) -> StageModule:
    """Load and partition the model by the stage plan (printed by rank 0; it estimates activations from
    ``dataset``, the cache), fill in this stage's weights, quantize, apply the adapter (or start it from a saved
    one), wrap the memory savers and build the PipelineModule. With ``trainable=False`` (sampling only) every
    parameter is frozen and activation checkpointing is left out."""
    run = cfg.run
    dtype = DTYPES[cfg.model.dtype]
    stage = load_for_stages(plugin, cfg.model, device, dtype)
    plan = make_plan(
        cfg, plugin, stage.model, stage.layers, dataset, on_gpu=device.type == "cuda", forward_only=not trainable
    )
    parts = plan.parts
    if layout.rank == 0:
        lines = [*format_plan(plan), *filter(None, [unconditional_line(plan, cfg, plugin)])]
        print("diffpipe: " + "\n".join(lines), flush=True)
    own = range(parts[layout.stage_id], parts[layout.stage_id + 1])
    swapped = swapped_blocks(stage.layers, own, plugin.spec.block_layers, run.blocks_to_swap)
    label = f"stage {layout.stage_id}" if layout.replica == 0 else None  # quantize_stage prints one line

    def load(indices: list[int]) -> None:  # swapped blocks are read straight into host memory
        for part, where in (([i for i in indices if i not in swapped], device),
                            ([i for i in indices if i in swapped], torch.device("cpu"))):  # fmt: skip
            if part:
                materialise_layers(plugin, cfg.model, stage, part, where)

    if stage.per_stage_loading and not cfg.model.merge_adapters:  # a quantized base: each block as it is read
        load_quantized(cfg.model, stage, list(own), plugin.spec.block_layers, load, label)
    else:
        if stage.per_stage_loading:
            load(list(own))
        if cfg.model.merge_adapters:  # into the full-precision weights, before quantize_stage quantizes them
            merged = merge_into(stage.model, cfg.model.merge_adapters,
                                plugin.call("adapter_key_prefix") or "transformer", native_targets(plugin, cfg.model))
            if label:
                print(f"diffpipe: {label}: merged {len(cfg.model.merge_adapters)} adapter(s) into the base "
                      f"({merged} module updates)", flush=True)
        quantize_stage(cfg.model, stage, own, plugin.spec.block_layers, label)
    model = stage.model
    layer_names = [type(layer).__name__ for layer in stage.layers]
    torch.manual_seed(run.seed)
    lora = None
    if run.adapter is not None:
        targets = run.adapter.target_modules or plugin.require("lora_targets", model_config=cfg.model)
        lora = excluding(model, from_adapter_table(run.adapter, list(targets)), run.adapter.exclude_modules)
        adapt_layers(model, stage.layers, lora, DTYPES[run.adapter.dtype])
        if run.adapter.init_from_existing:
            init_adapter_from(model, plugin, run.adapter.init_from_existing, lora)
    if not trainable:
        model.requires_grad_(False)
    elif run.adapter is None:
        for p in model.parameters():
            p.requires_grad_(p.is_floating_point())
    if trainable:  # a parameter group at learning rate 0 is frozen, not stepped at 0
        freeze_zero_lr_groups(model, run.optimizer, plugin.call("parameter_groups", model_config=cfg.model))
    checkpointing = run.activation_checkpointing if trainable else False
    if run.compile:
        keep_compiled_backward_buffers()
        compile_blocks(stage.layers, own, plugin.spec.block_layers, "inductor" if run.compile is True else run.compile)
    layers, n_swapped = wrap_stage_layers(
        stage.layers, own, plugin.spec.block_layers, checkpointing, run.blocks_to_swap, device
    )
    seeds = LayerSeeds(run.seed, own.start, layout.dp, layout.dp_rank)
    layers = seed_stage_layers(layers, own, seeds)
    if layout.seq > 1:  # hooks on the block layers themselves, under any memory-saver wrapper
        from diffpipe_core.engine.sequence_parallel import sequence_groups, setup

        group = sequence_groups(layout.stages, layout.replicas, layout.seq)
        attentions = setup(stage.layers, own, plugin.spec, layout.seq, layout.seq_rank, group)
        if layout.replica == 0:
            print(f"diffpipe: stage {layout.stage_id}: its blocks run on 1/{layout.seq} of the tokens on each of "
                  f"{layout.seq} sequence ranks; {attentions} attention modules through DeepSpeed's Ulysses "
                  "all-to-all", flush=True)
    if layout.rank == 0:
        explain_memory_savers(cfg, plugin, device, lora is not None, n_swapped)
    loss = LossFunction(plugin, TrainingContext(model_config=cfg.model, loss=run.loss))
    with library_prints():  # DeepSpeed prints SEED_LAYERS=... and "Using topology: ..." here
        module = ExplicitPartitionPipelineModule(
            layers=wrap_stage_boundaries(layers, parts),
            parts=parts,
            num_stages=layout.stages,
            loss_fn=loss,
            dynamic_shape=True,
        )
    return StageModule(model, layer_names, parts, own, lora, module, loss, plan, seeds)


def build_stage(
    cfg: ResolvedConfig,
    plugin: ModelPlugin,
    layout: Layout,
    device: torch.device,
    total_steps: int,
    dataset: Any = None,
) -> Stage:
    """The training stage: :func:`build_stage_module` (its plan's activations from ``dataset``, the cache), then
    the optimizer, LR schedule and DeepSpeed engine."""
    run = cfg.run
    built = build_stage_module(cfg, plugin, layout, device, dataset=dataset)
    model, own, lora = built.model, built.own, built.lora
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad and p.device.type != "meta"}
    if not trainable:
        raise ValueError(
            f"pipeline stage {layout.stage_id} (layers {own.start}..{own.stop - 1}) has no trainable parameters; "
            "change partition_split or the adapter's target_modules"
        )
    named_groups = plugin.call("parameter_groups", model_config=cfg.model)
    groups = parameter_groups(run.optimizer, trainable, named_groups)
    for group in groups:
        group["lr"] = forced_lr(run.optimizer, group["lr"])
    optimizer = build_optimizer(run.optimizer, groups, plugin.registry.pm, lora is not None, run.zero_stage > 0)
    if run.optimizer.offload:
        offload_state(optimizer)  # before the LR schedule wraps its step
    release = None
    if run.optimizer.gradient_release:
        if layout.replicas > 1:
            raise ValueError(
                f"optimizer.gradient_release: this run has {layout.dp} data-parallel replicas per stage "
                f"({layout.world} processes, {layout.stages} stage(s)); a released parameter is stepped before the "
                "replicas' gradients could be averaged, so gradient release needs as many processes as "
                "pipeline_stages"
            )
        release = GradientRelease(optimizer, list(trainable.values()), run.gradient_clipping)
    scheduler = LambdaLR(optimizer, run_lr_lambda(run, total_steps))
    guard = OptimizerGuard(optimizer, list(trainable.values()), run.gradient_clipping, layout.replicas, device)
    guard.release = release
    if lora is not None:
        networks = [g["params"] for g in groups] if len(groups) > 1 else plugin_groups(trainable, named_groups)
        guard.first_step_check = lambda: _check_lora_gradients(trainable, layout.stage_id, networks)
    ds_config = {
        "train_micro_batch_size_per_gpu": run.default_micro_batch_size,  # bookkeeping only: sizes may vary
        "gradient_accumulation_steps": run.gradient_accumulation_steps,
        "gradient_clipping": 0.0,  # done by OptimizerGuard
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        **zero_config(run.zero_stage),
    }
    engine, _, _, _ = deepspeed.initialize(
        model=built.module,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_config,
        model_parameters=list(trainable.values()),
    )
    zero = shard_optimizer_state(engine, guard) if run.zero_stage else None
    skip_single_replica_allreduce(engine)
    keep_idle_groups_gradless(engine, [g["params"] for g in groups])
    lean_step(engine)
    release_forward_inputs(engine)
    if release is not None:
        single_backward(engine)
    if layout.stage_id > 0:
        producer = built.parts[layout.stage_id] - 1
        name_gradless_boundary_tensors(engine, f"layer {producer} ({built.layer_names[producer]})")
    if device.type == "cpu":
        release_freed_before_instructions(engine)  # last: it wraps the instructions the patches above installed
    ema = EmaWeights(run.ema, trainable) if run.ema is not None else None
    base = FrozenBase(model, trainable, lora is not None) if needs_base(dataset) else None
    return Stage(
        model, built.layer_names, built.parts, built.lora, trainable, optimizer, scheduler, guard, engine, built.loss,
        built.plan, built.seeds, ema, base, zero,
    )


def shard_optimizer_state(engine: Any, guard: OptimizerGuard) -> Any:
    """``zero_stage = 1``: point the guard at what DeepSpeed's ZeRO optimizer hands the client optimizer, this
    replica's float32 partition, whose gradient is the replicas' average of its share (the replicas' squared norms
    add up to the stage's, so none is divided out), and check the adapter's gradients before the reduction frees
    them. Returns the ZeRO optimizer."""
    import warnings

    # DeepSpeed all-gathers the updated weights with a torch call that warns of its deprecation every step
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor` is deprecated", category=FutureWarning)
    zero = engine.optimizer
    guard.params = [p for group in guard.optimizer.param_groups for p in group["params"]]
    guard.dp = 1
    check, guard.first_step_check = guard.first_step_check, None
    if check is not None:
        reduce = engine.allreduce_gradients

        def allreduce_gradients(*args: Any, **kwargs: Any) -> Any:
            nonlocal check
            if check is not None:
                check, run = None, check
                run()
            return reduce(*args, **kwargs)

        engine.allreduce_gradients = allreduce_gradients
    return zero


def build_inference_engine(cfg: ResolvedConfig, plugin: ModelPlugin, layout: Layout, device: torch.device) -> Any:
    """A forward-only pipeline engine (``diffpipe sample``): the same stage as training builds, every parameter
    frozen, no optimizer, no dataset."""
    built = build_stage_module(cfg, plugin, layout, device, trainable=False)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    with library_prints():
        engine, _, _, _ = deepspeed.initialize(model=built.module, config=ds_config)
    return engine


def compile_blocks(
    layers: list[nn.Module], own: range, block_layers: tuple[str, ...], backend: str = "inductor"
) -> int:
    """``torch.compile`` this stage's block layers in place (every own layer when the model names no blocks), so
    parameter names, adapters and saving are unchanged. Returns how many were compiled."""
    picked = stage_blocks(layers, own, block_layers) if block_layers else list(own)
    for i in picked:
        layers[i].compile(backend=backend)
    return len(picked)


def explain_memory_savers(
    cfg: ResolvedConfig, plugin: ModelPlugin, device: torch.device, lora: bool, n_swapped: int
) -> None:
    """One line saying what ``blocks_to_swap`` does in this run (or why it does nothing)."""
    run, spec = cfg.run, plugin.spec
    if not run.blocks_to_swap:
        return
    if not spec.block_layers:
        print(f"diffpipe: blocks_to_swap ignored: model {spec.name!r} names no block layers", flush=True)
    elif device.type != "cuda":
        print("diffpipe: blocks_to_swap has no effect without a GPU (weights live in host memory)", flush=True)
    elif not lora:
        print("diffpipe: blocks_to_swap moves frozen weights only; a full fine-tune trains them all", flush=True)
    elif getattr(cfg.model, "quantize", None):
        print("diffpipe: blocks_to_swap moves unquantized weights only; quantized ones stay on the GPU", flush=True)
    else:
        print(f"diffpipe: swapping {n_swapped} blocks per stage with host memory", flush=True)


def init_adapter_from(model: nn.Module, plugin: ModelPlugin, path: Path, config: PeftConfig) -> None:
    """Start the adapter from a saved one (``[adapter] init_from_existing``): this stage's adapter tensors only."""
    state, saved = read_adapter(path)
    kind = kind_of(config)
    if saved.get("peft_type", "LORA") != kind.peft_type:
        raise ValueError(
            f"adapter.init_from_existing: {path} holds a {saved.get('peft_type', 'LORA')} adapter; this run trains "
            f"type = {kind.name!r}"
        )
    prefix = plugin.call("adapter_key_prefix") or "transformer"
    named = {n.replace(".default", ""): p for n, p in model.named_parameters() if is_adapter_param(n)}
    factor = unfold_factor(config_from_saved(saved), config)  # saved files carry their strength folded in
    loaded = 0
    for key, value in state.items():
        if key.endswith(".alpha"):
            continue
        bare = key[len(prefix) + 1 :] if key.startswith(prefix + ".") else key
        param = named.get(bare)
        if param is not None and param.device.type != "meta":
            if param.shape != value.shape:
                raise ValueError(
                    f"adapter.init_from_existing: {path}: {key} has shape {tuple(value.shape)}, this run's adapter "
                    f"{tuple(param.shape)}; the rank, factor or target modules differ"
                )
            if factor != 1.0 and any(part in STRENGTH_TENSORS for part in bare.split(".")):
                value = value.float() * factor
            param.data.copy_(value.to(param.dtype))
            loaded += 1
    if loaded == 0 and any(p.device.type != "meta" for p in named.values()):
        raise ValueError(f"adapter.init_from_existing: {path} has no keys matching this model's adapter layers")


def _check_lora_gradients(trainable: dict[str, torch.Tensor], stage_id: int, networks: list[list]) -> None:
    """After the first step's backward: an adapter tensor without a gradient is not in the forward path (unless its
    whole parameter group, the optimizer's or the plugin's, got none: that group's network sat the step out)."""
    unused = lora_without_gradient(trainable, networks if len(networks) > 1 else None)
    if unused:
        shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
        raise ValueError(
            f"pipeline stage {stage_id}: the adapter tensors {shown} got no gradient in the first step: their modules "
            "are not in the model's forward path (the plugin's layers never call them), so they would never train; "
            "leave them out of [adapter] target_modules"
        )
