"""What each pipeline layer costs in memory: the cost model the ``memory`` partition balances.

Per layer, from a meta twin of the model (same modules, weights on meta, so nothing is read or computed):

- weights in their real dtypes (the skeleton's: float32-kept modules are float32), block linears at their quantized
  size when ``[model] quantize`` is set; the part block swap would move to host memory is kept apart;
- the trainable tensors (the adapter's own: LoRA, LoKr or LoHa, in ``[adapter] dtype``; or every float weight of a
  full fine-tune) with their gradients and optimizer state, and their ``[ema]`` copy when it lives on the stage's
  device (``device = "cpu"`` keeps it in host memory: ``host_state_bytes``, as an offloaded optimizer state is);
  with ``[optimizer] gradient_release`` no gradient buffer (``largest_grad_bytes``: the one gradient held at a time);
- with ``[model] merge_adapters``, what merging holds on the device at load, for the layer's largest weight
  (``merge_bytes``: that weight in float32, the delta, their sum, and the result in the weight's dtype);
- what the layer keeps for backward for one micro-batch of the largest bucket, measured by a meta forward of the
  twin with the run's adapter (:mod:`diffpipe_core.engine.activations`), when first-layer inputs are given.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from diffpipe_core.adapter_kinds import from_adapter_table, is_adapter_param
from diffpipe_core.adapters import apply_adapter, excluding
from diffpipe_core.config import ResolvedConfig
from diffpipe_core.engine.activations import LayerTensors, Measurement, measure_layers
from diffpipe_core.engine.partition import layer_param_counts
from diffpipe_core.quantize import quantizable_linears, quantized_weight_bytes
from diffpipe_core.registry import ModelPlugin

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LayerCost:
    """One layer's memory. Shared tensors (a weight two layers hold) count in the first layer that holds them."""

    name: str
    params: int
    weight_bytes: int  # every weight of the layer as the stage holds it (frozen ones quantized where set)
    swappable_bytes: int  # the part of weight_bytes block swap would keep in host memory (frozen float weights)
    block: bool  # one of the model's ModelSpec.block_layers
    trainable: int  # trainable parameters (LoRA weights, or all float weights of a full fine-tune)
    state_bytes: int  # gradients and optimizer state of those, plus the LoRA weights themselves
    tensors: LayerTensors  # what its forward keeps for backward, takes in and sends on (empty when not measured)
    trainable_bytes: int = 0  # the trainable tensors' own bytes (what a save gathers and converts)
    optimizer_bytes: int = 0  # their optimizer state alone (what a checkpoint serialises in memory)
    host_state_bytes: int = 0  # trained state kept in host memory: offloaded optimizer state, an [ema] on the cpu
    largest_grad_bytes: int = 0  # gradient release: the largest single gradient (the one held while it steps)
    merge_bytes: int = 0  # merge_adapters: the device memory merging into the layer's largest weight takes at load


@dataclass
class ModelCosts:
    layers: list[LayerCost]
    measured: bool  # activations were measured (first-layer inputs were given)
    failed: str | None = None  # the layer whose meta forward failed (later layers borrow numbers)
    measurement: Measurement | None = None  # the activations' measurement these costs were made from


def weights_only_costs(layers: list[nn.Module]) -> ModelCosts:
    """Costs from the layers' own tensors alone (no twin, no adapter, no activations): the fallback when a model
    cannot be copied as a meta twin. Every layer counts as trainable (unknown)."""
    counts = layer_param_counts(layers)
    seen: set[int] = set()
    costs = []
    for i, layer in enumerate(layers):
        weight = 0
        for t in [*layer.parameters(), *layer.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                weight += _bytes(t)
        costs.append(LayerCost(type(layer).__name__, counts[i], weight, 0, False, 1, 0, LayerTensors(measured=False)))
    return ModelCosts(costs, measured=False)


def meta_twin(model: nn.Module, layers: list[nn.Module]) -> tuple[nn.Module, list[nn.Module]]:
    """A copy of the model and its pipeline layers whose weights are meta tensors of the same shapes and dtypes;
    nothing is copied from the model's (possibly real) weights."""
    memo: dict[int, object] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo:
            continue
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    twin, twin_layers = copy.deepcopy((model, layers), memo)
    return twin, list(twin_layers)


def optimizer_state_bytes(kind: str, numel: int, dtype: torch.dtype, ndim: int = 2) -> int:
    """Optimizer state of one trainable tensor: AdamW two moments in its dtype; the 8-bit ones one byte each (32-bit
    below bitsandbytes' 4096-element threshold) plus block scales; Kahan adds a compensation buffer (adamw8bit_kahan,
    and optimi's and automagic's for bf16/fp16 weights); SGD none; Muon one momentum buffer for a 2-D weight (AdamW's
    two moments for the rest); automagic an int8 rate and a sign per element (its factored second moment is a row and
    a column). Other optimizers a plugin registers are assumed AdamW-like."""
    size = torch.empty((), dtype=dtype).element_size()
    kahan = numel * size if dtype != torch.float32 else 0
    if kind == "sgd":
        return 0
    if kind in ("adamw8bit", "adamw8bit_kahan"):
        moments = 2 * numel + 2 * 4 * -(-numel // 256) if numel >= 4096 else 2 * 4 * numel
        return moments + (kahan if kind == "adamw8bit_kahan" else 0)
    if kind in ("adamw_optimi", "stableadamw"):
        return 2 * numel * size + kahan
    if kind == "automagic":
        return 2 * numel + kahan + (0 if ndim >= 2 else 4 * numel)
    if kind == "muon" and ndim == 2:
        return numel * size
    return 2 * numel * size


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class AdaptedTwin:
    """The meta twin of a model and its layers with the run's adapter injected (what :func:`layer_costs` counts and
    measures), and the names of its modules; the base model's parameter counts per layer."""

    model: nn.Module
    layers: list[nn.Module]
    names: dict[int, str]
    counts: list[int]


def adapted_twin(cfg: ResolvedConfig, plugin: ModelPlugin, model: nn.Module, layers: list[nn.Module]) -> AdaptedTwin:
    """The meta twin of ``model`` / ``layers`` (left unchanged) with the run's adapter (``[adapter]``; a full
    fine-tune makes every float weight trainable). The adapter's modules are built on the meta device: nothing is
    allocated or initialised. Build it once per model and adapter; :func:`layer_costs` reuses it."""
    run = cfg.run
    counts = layer_param_counts(layers)  # the base model's, as partition_method = "parameters" counts them
    twin, twin_layers = meta_twin(model, layers)
    if run.adapter is not None:
        targets = run.adapter.target_modules or plugin.require("lora_targets", model_config=cfg.model)
        config = excluding(twin, from_adapter_table(run.adapter, list(targets)), run.adapter.exclude_modules)
        with torch.device("meta"):  # peft's new modules: shapes only, no initialisation
            apply_adapter(twin, config)  # the kind's own tensors
        for name, p in twin.named_parameters():
            if is_adapter_param(name):
                p.data = p.data.to(DTYPES[run.adapter.dtype])  # apply_adapter leaves meta tensors as they are
    else:
        for p in twin.parameters():
            p.requires_grad_(p.is_floating_point())
    twin.train()
    names = {id(m): n for n, m in twin.named_modules(remove_duplicate=False)}
    return AdaptedTwin(twin, twin_layers, names, counts)


def layer_costs(
    cfg: ResolvedConfig,
    plugin: ModelPlugin,
    model: nn.Module,
    layers: list[nn.Module],
    inputs: tuple[torch.Tensor, ...] | None = None,
    measurement: Measurement | None = None,
    twin: AdaptedTwin | None = None,
) -> ModelCosts:
    """The cost of each of ``layers`` (of ``model``, on any device; it is not changed) under this run's settings.
    ``inputs``: the first layer's inputs for one micro-batch of the largest bucket; without them no activations.
    ``measurement``: activations already measured for these layers under the same adapter (reused, not measured
    again: what changes between the GPU-fit planner's candidates is the weights' storage, not the forward).
    ``twin``: :func:`adapted_twin` of the same model, layers and adapter, made before (reused, not copied again)."""
    run = cfg.run
    made = twin if twin is not None else adapted_twin(cfg, plugin, model, layers)
    twin_model, twin_layers, counts = made.model, made.layers, made.counts
    block_names = set(plugin.spec.block_layers)
    mode = getattr(cfg.model, "quantize", None)
    if measurement is None and inputs is not None:
        measurement = measure_layers(twin_layers, inputs)
    seen: set[int] = set()
    costs = []
    for i, layer in enumerate(twin_layers):
        block = type(layer).__name__ in block_names
        quantized: dict[int, int] = {}
        if mode is not None and block:
            chosen, _ = quantizable_linears(twin_model, layer, made.names)
            quantized = {id(m.weight): quantized_weight_bytes(mode, m.out_features, m.in_features) for m in chosen}
        weight = swappable = trainable = state = trainable_bytes = optimizer = host_state = largest_grad = merge = 0
        for t in [*layer.parameters(), *layer.buffers()]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            size = quantized.get(id(t), _bytes(t))
            if t.requires_grad:
                trainable += t.numel()
                trainable_bytes += _bytes(t)
                kept = optimizer_state_bytes(run.optimizer.type, t.numel(), t.dtype, t.dim())
                optimizer += kept
                # + gradient; an offloaded state is in host memory (the device holds one tensor's while it steps)
                state += 2 * _bytes(t) + (0 if run.optimizer.offload else kept)
                host_state += kept if run.optimizer.offload else 0
                if run.optimizer.gradient_release:  # no gradient buffer: one gradient at a time (a transient)
                    state -= _bytes(t)
                    largest_grad = max(largest_grad, _bytes(t))
                if run.ema is not None and run.ema.device == "stage":  # [ema]: one more copy beside the weights
                    state += _bytes(t)
                elif run.ema is not None:  # device = "cpu": in host memory
                    host_state += _bytes(t)
                if run.adapter is None:  # a full fine-tune's weights are weights; LoRA's count with the states
                    weight, state = weight + _bytes(t), state - _bytes(t)
            base_weight = run.adapter is None or not t.requires_grad  # not the trained adapter's own tensor
            if getattr(cfg.model, "merge_adapters", None) and base_weight and t.is_floating_point() and t.dim() >= 2:
                merge = max(merge, t.numel() * (3 * 4 + t.element_size()))
            if not t.requires_grad:
                weight += size
                if block and id(t) not in quantized and t.is_floating_point() and isinstance(t, nn.Parameter):
                    swappable += size
        tensors = measurement.layers[i] if measurement is not None else LayerTensors(measured=False)
        costs.append(
            LayerCost(type(layer).__name__, counts[i], weight, swappable, block, trainable, state, tensors,
                      trainable_bytes, optimizer, host_state, largest_grad, merge)
        )  # fmt: skip
    return ModelCosts(costs, measurement is not None, measurement.failed if measurement else None, measurement)

