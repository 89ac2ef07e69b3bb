"""Build this rank's pipeline stage: load and partition the model, fill in the stage's weights, quantize,
apply the adapter, wrap the memory savers, and hand it all to DeepSpeed with the optimizer and LR schedule."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
from peft import LoraConfig
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from diffpipe_core.adapters import apply_lora, lora_config, read_adapter
from diffpipe_core.config import ResolvedConfig
from diffpipe_core.engine.ds_patches import (
    ExplicitPartitionPipelineModule,
    name_gradless_boundary_tensors,
    wrap_stage_boundaries,
)
from diffpipe_core.engine.model_loading import load_for_stages, materialise_layers
from diffpipe_core.engine.optimizer_guard import OptimizerGuard
from diffpipe_core.engine.partition import stage_parts
from diffpipe_core.memory import swapped_blocks, wrap_stage_layers
from diffpipe_core.optim import build_optimizer, lr_lambda, parameter_groups
from diffpipe_core.quantize import quantize_stage
from diffpipe_core.quiet import library_prints
from diffpipe_core.registry import ModelPlugin

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: pipeline stage ``stage_id`` of ``stages``, data-parallel replica ``dp_rank`` of ``dp``."""

    rank: int
    world: int
    stages: int

    @property
    def dp(self) -> int:
        return self.world // self.stages

    @property
    def stage_id(self) -> int:
        return self.rank // self.dp

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp


@dataclass
class Stage:
    """What :func:`build_stage` made for this rank."""

    model: nn.Module
    layer_names: list[str]
    parts: list[int]
    lora: LoraConfig | None
    trainable: dict[str, torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    guard: OptimizerGuard
    engine: Any


def build_stage(
    cfg: ResolvedConfig, plugin: ModelPlugin, layout: Layout, device: torch.device, total_steps: int
) -> Stage:
    run = cfg.run
    dtype = DTYPES[cfg.model.dtype]
    stage = load_for_stages(plugin, cfg.model, device, dtype)
    parts = stage_parts(stage.layers, layout.stages, run.partition_method, run.partition_split)
    own = range(parts[layout.stage_id], parts[layout.stage_id + 1])
    swapped = swapped_blocks(stage.layers, own, plugin.spec.block_layers, run.blocks_to_swap)
    if stage.per_stage_loading:  # swapped blocks are read straight into host memory
        resident = [i for i in own if i not in swapped]
        materialise_layers(plugin, cfg.model, stage, resident, device)
        materialise_layers(plugin, cfg.model, stage, swapped, torch.device("cpu"))
    label = f"stage {layout.stage_id}" if layout.dp_rank == 0 else None  # quantize_stage prints one line
    quantize_stage(cfg.model, stage, own, plugin.spec.block_layers, label)
    model = stage.model
    layer_names = [type(layer).__name__ for layer in stage.layers]
    torch.manual_seed(run.seed)
    lora = None
    if run.adapter is not None:
        targets = run.adapter.target_modules or plugin.require("lora_targets", model_config=cfg.model)
        lora = lora_config(run.adapter.rank, run.adapter.effective_alpha, run.adapter.dropout, list(targets))
        apply_lora(model, lora, DTYPES[run.adapter.dtype])
        if run.adapter.init_from_existing:
            init_adapter_from(model, plugin, run.adapter.init_from_existing)
    else:
        for p in model.parameters():
            p.requires_grad_(p.is_floating_point())
    layers, n_swapped = wrap_stage_layers(
        stage.layers, own, plugin.spec.block_layers, run.activation_checkpointing, run.blocks_to_swap, device
    )
    if layout.rank == 0:
        explain_memory_savers(cfg, plugin, device, lora is not None, n_swapped)
    with library_prints():  # DeepSpeed prints SEED_LAYERS=... and "Using topology: ..." here
        module = ExplicitPartitionPipelineModule(
            layers=wrap_stage_boundaries(layers, parts),
            parts=parts,
            num_stages=layout.stages,
            loss_fn=lambda outputs, targets: plugin.require("compute_loss", outputs=outputs, targets=targets),
            dynamic_shape=True,
        )
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad and p.device.type != "meta"}
    if not trainable:
        raise ValueError(
            f"pipeline stage {layout.stage_id} (layers {own.start}..{own.stop - 1}) has no trainable parameters; "
            "change partition_split or the adapter's target_modules"
        )
    groups = plugin.call("parameter_groups", model_config=cfg.model)
    optimizer = build_optimizer(run.optimizer, parameter_groups(trainable, groups), plugin.registry.pm)
    scheduler = LambdaLR(optimizer, lr_lambda(run.lr_scheduler, run.warmup_steps, total_steps))
    guard = OptimizerGuard(optimizer, list(trainable.values()), run.gradient_clipping, layout.dp, device)
    ds_config = {
        "train_micro_batch_size_per_gpu": run.micro_batch_size_per_gpu,
        "gradient_accumulation_steps": run.gradient_accumulation_steps,
        "gradient_clipping": 0.0,  # done by OptimizerGuard
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_config,
        model_parameters=list(trainable.values()),
    )
    if layout.stage_id > 0:
        producer = parts[layout.stage_id] - 1
        name_gradless_boundary_tensors(engine, f"layer {producer} ({layer_names[producer]})")
    return Stage(model, layer_names, parts, lora, trainable, optimizer, scheduler, guard, engine)


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


def init_adapter_from(model: nn.Module, plugin: ModelPlugin, path: Path) -> None:
    """Start the adapter from a saved one (``[adapter] init_from_existing``): this stage's LoRA tensors only."""
    state, _ = read_adapter(path)
    prefix = plugin.call("adapter_key_prefix") or "transformer"
    named = dict(model.named_parameters())
    loaded = 0
    for key, value in state.items():
        if key.endswith(".alpha"):
            continue
        bare = key[len(prefix) + 1 :] if key.startswith(prefix + ".") else key
        name = bare.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
        if name in named and named[name].device.type != "meta":
            named[name].data.copy_(value.to(named[name].dtype))
            loaded += 1
    if loaded == 0 and any(p.device.type != "meta" for n, p in named.items() if "lora_" in n):
        raise ValueError(f"adapter.init_from_existing: {path} has no keys matching this model's LoRA layers")
