"""Fit a run into a GPU's memory: the cheapest combination of memory savers whose stage plan fits each GPU.

``diffpipe validate --plan --gpu-memory 24GB [--gpus N]`` searches, with the stage plan's own estimator
(:mod:`diffpipe_core.engine.stage_plan`, the figures ``diffpipe validate --plan`` prints), every combination of

- ``pipeline_stages``: a divisor of the GPUs (data parallelism takes the rest), each split by ``partition_method =
  "memory"``;
- ``activation_checkpointing``: off, on, ``"offload"`` (the last only on a GPU, where it moves memory to the host);
- ``blocks_to_swap``: the fewest blocks per stage that fit (GPU only: on a CPU host and device are one memory);
- ``[model] quantize`` of the frozen block weights (LoRA runs only): none, ``float8``, ``int8``, ``nf4`` (``nf4``
  with ``[adapter] type = "lora"`` only), never less than the config already has,

and picks the **cheapest** that fits. Cheapest means least estimated step time first, quality loss last:

1. no quantization before any, then ``float8`` (8-bit, computes in the model's dtype), ``int8``, ``nf4`` (4-bit):
   quantizing changes the weights the LoRA trains against, which no step-time gain makes up for;
2. within one quantization, the least estimated step time, relative to one stage without savers, as the product of
   - the pipeline bubble of DeepSpeed's 1F1B schedule, ``(gradient_accumulation_steps + stages - 1) /
     gradient_accumulation_steps`` (the user's accumulation: 2 stages at 4 micro-batches cost 1.25);
   - activation checkpointing ``4/3`` (one more forward of the blocks, a forward being about a third of forward +
     backward), ``"offload"`` ``4/3 + 0.05`` (the host copies of the blocks' inputs);
   - block swap ``1 + 0.25 x`` the share of the stage's blocks swapped (the copies overlap compute; 0.25 is what is
     left when they do not fully hide, a guess until GPU timings replace it);
3. ties: fewer stages, then no checkpointing before checkpointing before offload, then fewer swapped blocks.

A layout whose data-parallel replicas (GPUs / stages) the cached dataset cannot feed a step each (fewer full
micro-batches per replica than ``gradient_accumulation_steps``: the trainer refuses it) is not offered; the answer
names the layouts left out and why.

The estimates count what each stage holds (weights, trainable state, activations of the micro-batches in flight at
the run's largest bucket, the checkpoint's and save's transients) and, with a quantized base, its load's transient
(each block is read at full precision, then quantized); not the CUDA context or allocator slack: leave a margin.
Activations need the cached dataset (``diffpipe cache``); without it the plan says so and counts none.
``on_gpu=False`` plans a CPU run (tests/test_gpu_fit.py measures one): there block swap and offload save nothing and
are not offered, nor are ``int8`` and ``nf4`` (bitsandbytes' CUDA kernels).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from diffpipe_core.config import ResolvedConfig
from diffpipe_core.engine.stage_costs import ModelCosts
from diffpipe_core.engine.stage_plan import StagePlan, plan_stages
from diffpipe_core.registry import ModelPlugin

GiB = 2**30
QUANTIZE_ORDER: tuple[str | None, ...] = (None, "float8", "int8", "nf4")
CHECKPOINTING: tuple[bool | str, ...] = (False, True, "offload")
CHECKPOINT_COST = {False: 1.0, True: 4 / 3, "offload": 4 / 3 + 0.05}
SWAP_COST = 0.25
_UNITS = {"": GiB, "g": GiB, "gb": GiB, "gib": GiB, "m": 2**20, "mb": 2**20, "mib": 2**20, "t": 2**40, "tb": 2**40,
          "tib": 2**40}  # fmt: skip
MEMORY_FORMS = "a positive number of GB (= GiB, as GPU makers and nvidia-smi count), e.g. 24GB, 80GiB, 23.5G, 24000MB"


def parse_memory(text: str, option: str = "--gpu-memory") -> int:
    """Bytes from ``"24GB"`` / ``"24GiB"`` / ``"24G"`` / ``"24"`` (GB) / ``"24000MB"``. "GB" counts 2**30 bytes, as
    GPU makers' figures do (a "24 GB" card has 24,564 MiB). Raises ValueError naming ``option`` and the valid forms."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{option}: {text!r} is not a memory size; valid: {MEMORY_FORMS}")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class Choice:
    """One combination of savers."""

    stages: int
    checkpointing: bool | str
    swap: int
    quantize: str | None

    def step_cost(self, gas: int, blocks_per_stage: int) -> float:
        """Estimated step time relative to one stage without savers (the module docstring's model)."""
        bubble = (gas + self.stages - 1) / gas
        swapped = self.swap / blocks_per_stage if blocks_per_stage else 0.0
        return bubble * CHECKPOINT_COST[self.checkpointing] * (1 + SWAP_COST * swapped)

    def describe(self) -> str:
        parts = [f"{self.stages} stage{'s' if self.stages > 1 else ''}"]
        if self.checkpointing:
            parts.append("activation checkpointing" + (" offloaded" if self.checkpointing == "offload" else ""))
        if self.swap:
            parts.append(f"{self.swap} block{'s' if self.swap > 1 else ''} swapped per stage")
        if self.quantize:
            parts.append(f"{self.quantize} base")
        return ", ".join(parts) if len(parts) > 1 else parts[0] + ", no savers"


@dataclass
class Fit:
    """The planner's answer: the cheapest ``choice`` whose ``plan`` fits (``fits``), or the plan that comes closest
    (its largest stage over the budget by ``shortfall`` bytes)."""

    budget: int
    gpus: int
    choice: Choice
    plan: StagePlan
    fits: bool
    cost: float
    gas: int
    activations: str
    base: StagePlan | None = None  # the config as it is, on one stage per GPU group
    unfed: tuple[int, ...] = ()  # stage counts left out: their replicas get less than a step of data each
    micro_batches: int | None = None  # full micro-batches an epoch of the cached dataset gives

    @property
    def peak(self) -> int:
        return _peak(self.plan)

    @property
    def shortfall(self) -> int:
        return max(0, self.peak - self.budget)


class FitSource:
    """The run's model on the meta device, cut into layers, with the first layer's inputs for one micro-batch of its
    largest cached bucket (none when the dataset is not cached): costs per quantization, activations measured once."""

    def __init__(self, cfg: ResolvedConfig, plugin: ModelPlugin, dataset: Any = None, inputs: Any = None) -> None:
        import torch

        from diffpipe_core.engine.plan_build import DTYPES, example_inputs

        self.cfg, self.plugin = cfg, plugin
        try:
            self.model = plugin.require(
                "load_diffusion_model", model_config=cfg.model, device=torch.device("meta"),
                dtype=DTYPES[cfg.model.dtype],
            )  # fmt: skip
            self.layers = list(plugin.require("split_into_layers", model=self.model, model_config=cfg.model))
        except Exception as exc:
            raise ValueError(f"model plugin {plugin.name!r} cannot build its model on the meta device: {exc}") from None
        self.activations = "not estimated: the dataset is not cached yet (diffpipe cache); the fit counts none"
        self.inputs = inputs
        if inputs is not None:
            self.activations = "given inputs"
        elif dataset is not None:
            self.inputs, self.activations = example_inputs(dataset, plugin, cfg)
        self.micro_batches: int | None = None  # full micro-batches an epoch gives (None: dataset not cached)
        if dataset is not None:
            from diffpipe_core.engine.micro_batches import full_micro_batches

            self.micro_batches = full_micro_batches(cfg.run, dataset)
        # a quantized base loaded at full precision as a whole (merged into first, or no per-stage loading)
        self.whole_stage_load = bool(getattr(cfg.model, "merge_adapters", None)) or not plugin.has(
            "diffusion_model_weights"
        )
        self._costs: dict[str | None, ModelCosts] = {}
        self._twin: Any = None  # the adapted meta twin, made once: every quantization and resolution counts on it
        self.plans: dict[tuple[Choice, bool], StagePlan] = {}  # by choice and device, for several budgets

    def with_inputs(self, inputs: Any) -> FitSource:
        """The same model with other first-layer inputs (another resolution): its costs are measured anew."""
        other = FitSource.__new__(FitSource)
        other.__dict__.update(self.__dict__)
        other.inputs, other._costs, other.plans, other.activations = inputs, {}, {}, "given inputs"
        return other

    @property
    def blocks(self) -> int:
        names = set(self.plugin.spec.block_layers)
        return sum(type(layer).__name__ in names for layer in self.layers)

    def costs(self, quantize: str | None) -> ModelCosts:
        from diffpipe_core.engine.stage_costs import adapted_twin, layer_costs

        if quantize not in self._costs:
            model_cfg = self.cfg.model.model_copy(update={"quantize": quantize})
            cfg = dataclasses.replace(self.cfg, model=model_cfg)
            done = next(iter(self._costs.values()), None)
            if self._twin is None:
                self._twin = adapted_twin(self.cfg, self.plugin, self.model, self.layers)
            self._costs[quantize] = layer_costs(
                cfg, self.plugin, self.model, self.layers, self.inputs, done.measurement if done else None, self._twin
            )
        return self._costs[quantize]


def candidates(cfg: ResolvedConfig, plugin: ModelPlugin, gpus: int, layers: int, on_gpu: bool) -> list[Choice]:
    """Every (stages, checkpointing, quantization) combination the run may take, swap left at 0 (searched later)."""
    stages = [s for s in range(1, gpus + 1) if gpus % s == 0 and s <= layers]
    current = getattr(cfg.model, "quantize", None)
    quantize: list[str | None] = [current]
    if cfg.run.adapter is not None and plugin.spec.block_layers:  # a full fine-tune of a quantized base is refused
        start = QUANTIZE_ORDER.index(current) if current in QUANTIZE_ORDER else len(QUANTIZE_ORDER)
        quantize += [q for q in QUANTIZE_ORDER[start + 1 :] if q != "nf4" or cfg.run.adapter.type == "lora"]
        if not on_gpu:  # bitsandbytes' int8 and nf4 need CUDA
            quantize = [q for q in quantize if q in (current, "float8")]
    checkpointing = [c for c in CHECKPOINTING if on_gpu or c != "offload"]
    return [Choice(s, c, 0, q) for q in quantize for s in stages for c in checkpointing]


def _plan(source: FitSource, choice: Choice, on_gpu: bool) -> StagePlan:
    """The stage plan of ``choice``; with a quantized base, each stage's ``load_bytes`` (what loading holds beside
    the stage's weights) grows by what its load holds at full precision (engine/stage_build.py): one block's weights
    beyond their quantized size, the largest of its resident (not swapped) blocks, since each block is quantized as
    soon as it is read (:func:`~diffpipe_core.quantize.load_quantized`); with ``[model] merge_adapters`` (merged
    into the full-precision weights first) or a plugin without per-stage loading, every resident layer's."""
    key = (choice, on_gpu)
    if key in source.plans:
        return source.plans[key]
    run = source.cfg.run.model_copy(update={
        "pipeline_stages": choice.stages, "activation_checkpointing": choice.checkpointing,
        "blocks_to_swap": choice.swap, "partition_method": "memory", "partition_split": None,
    })  # fmt: skip
    plan = plan_stages(source.costs(choice.quantize), run, choice.stages, on_gpu, source.activations)
    full = source.costs(None).layers if choice.quantize else None
    for est in plan.stages if full is not None else []:
        blocks = [k for k in range(est.start, est.stop) if full[k].block]
        swapped = set(blocks[len(blocks) - min(choice.swap, len(blocks)):]) if on_gpu and choice.swap else set()
        if source.whole_stage_load:
            load = sum(full[k].weight_bytes for k in range(est.start, est.stop) if k not in swapped)
            est.load_bytes += max(0, load - est.weight_bytes)
        else:
            quantized = source.costs(choice.quantize).layers
            est.load_bytes += max((full[k].weight_bytes - quantized[k].weight_bytes for k in blocks
                                   if k not in swapped), default=0)  # fmt: skip
    source.plans[key] = plan
    return plan


def stage_peak(est: Any) -> int:
    """A stage's estimated peak, its quantized base's full-precision load included (:func:`_plan`)."""
    return est.peak_bytes


def _peak(plan: StagePlan) -> int:
    return max(stage_peak(s) for s in plan.stages)


def _fewest_swapped(source: FitSource, choice: Choice, budget: int, on_gpu: bool) -> tuple[Choice, StagePlan]:
    """``choice`` with the fewest swapped blocks per stage that fits ``budget`` (binary search: more swapped blocks
    never hold more), or with every block swapped when none fits."""
    most = -(-source.blocks // choice.stages)
    plan = _plan(source, choice, on_gpu)
    if _peak(plan) <= budget or not on_gpu or most == 0:
        return choice, plan
    top = dataclasses.replace(choice, swap=most)
    top_plan = _plan(source, top, on_gpu)
    if _peak(top_plan) > budget:
        return top, top_plan
    lo, hi, best = 1, most, (top, top_plan)
    while lo < hi:
        mid = (lo + hi) // 2
        c = dataclasses.replace(choice, swap=mid)
        p = _plan(source, c, on_gpu)
        if _peak(p) <= budget:
            hi, best = mid, (c, p)
        else:
            lo = mid + 1
    if best[0].swap != lo:
        c = dataclasses.replace(choice, swap=lo)
        best = (c, _plan(source, c, on_gpu))
    return best


def fit_source(source: FitSource, budget: int, gpus: int = 1, on_gpu: bool = True) -> Fit:
    """The cheapest plan for ``source`` whose every stage's estimated peak is within ``budget`` bytes on ``gpus``
    GPUs (``on_gpu=False``: a CPU run, where block swap and offload save nothing and are not offered); when none
    fits, the one with the smallest largest stage."""
    if gpus < 1:
        raise ValueError(f"--gpus: {gpus}; valid: a whole number >= 1")
    cfg = source.cfg
    gas = cfg.run.gradient_accumulation_steps
    best: tuple[tuple, Choice, StagePlan, float] | None = None
    closest: tuple[int, Choice, StagePlan, float] | None = None
    offered = candidates(cfg, source.plugin, gpus, len(source.layers), on_gpu)
    unfed: set[int] = set()
    if source.micro_batches is not None:  # replicas the dataset cannot give a step each: the trainer refuses them
        unfed = {c.stages for c in offered if source.micro_batches // (gpus // c.stages) < gas}
        if len(unfed) < len({c.stages for c in offered}):  # when none is fed, all are planned and the answer says so
            offered = [c for c in offered if c.stages not in unfed]
    for raw in offered:
        choice, plan = _fewest_swapped(source, raw, budget, on_gpu)
        cost = choice.step_cost(gas, -(-source.blocks // choice.stages))
        peak = _peak(plan)
        if closest is None or peak < closest[0]:
            closest = (peak, choice, plan, cost)
        if peak > budget:
            continue
        ckpt = CHECKPOINTING.index(choice.checkpointing)
        key = (QUANTIZE_ORDER.index(choice.quantize) if choice.quantize in QUANTIZE_ORDER else 0, round(cost, 9),
               choice.stages, ckpt, choice.swap)  # fmt: skip
        if best is None or key < best[0]:
            best = (key, choice, plan, cost)
    assert closest is not None
    _, choice, plan, cost = best if best is not None else closest
    base = _plan(source, Choice(1, cfg.run.activation_checkpointing, cfg.run.blocks_to_swap,
                                getattr(cfg.model, "quantize", None)), on_gpu)  # fmt: skip
    return Fit(budget, gpus, choice, plan, best is not None, cost, gas, source.activations, base,
               tuple(sorted(unfed)), source.micro_batches)  # fmt: skip


def fit_config(cfg: ResolvedConfig, plugin: ModelPlugin, budget: int, gpus: int = 1, on_gpu: bool = True) -> Fit:
    """:func:`fit_source` for a validated run config: its model built on the meta device, its cached dataset (if
    any) read for the largest bucket's shapes. No weights are read."""
    from diffpipe_core.data.cache import open_cached

    return fit_source(FitSource(cfg, plugin, open_cached(cfg.run.dataset, plugin, cfg.model)), budget, gpus, on_gpu)


# ------------------------------------------------------------------------------------------------ printing
def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / 2**20:,.0f} MiB"


def fragment(fit: Fit) -> str:
    """The chosen savers as a ``run.toml`` fragment: top-level keys, then ``[model] quantize`` where one is set.
    Merged into the run config (its keys replace the config's), ``diffpipe validate`` accepts it."""
    c = fit.choice
    ckpt = '"offload"' if c.checkpointing == "offload" else str(bool(c.checkpointing)).lower()
    lines = [f"pipeline_stages = {c.stages}"]
    if c.stages > 1:
        lines.append('partition_method = "memory"')
    lines += [f"activation_checkpointing = {ckpt}", f"blocks_to_swap = {c.swap}"]
    if c.quantize is not None:
        lines += ["", "[model]", f'quantize = "{c.quantize}"']
    return "\n".join(lines) + "\n"


def format_fit(fit: Fit) -> list[str]:
    """What ``diffpipe validate --plan --gpu-memory`` prints: the verdict, the peak per GPU, and the fragment (or the
    shortfall)."""
    peaks = " / ".join(gib(stage_peak(s)) for s in fit.plan.stages)
    gpus = f"{fit.gpus} GPU{'s' if fit.gpus > 1 else ''} of {gib(fit.budget)}"
    lines = [f"GPU fit ({gpus}; estimates from the stage plan; activations: {fit.activations}):"]
    if fit.choice.quantize and any(s.weight_bytes + s.load_bytes == s.peak_bytes for s in fit.plan.stages):
        lines.append("  (a quantized base's blocks are read at full precision, then quantized: that load is the peak)")
    if fit.base is not None:
        lines.append(f"  as configured, on 1 stage: estimated peak {gib(_peak(fit.base))}")
    if fit.choice.stages in fit.unfed:
        lines.append(
            f"  no layout trains on this dataset: it gives {fit.micro_batches} full micro-batches an epoch, fewer than "
            f"gradient_accumulation_steps = {fit.gas} per replica on every layout of {fit.gpus} GPUs (the trainer "
            "refuses it); add data, or lower micro_batch_size_per_gpu or gradient_accumulation_steps"
        )
    for stages in () if fit.choice.stages in fit.unfed else fit.unfed:
        replicas = fit.gpus // stages
        lines.append(
            f"  not offered: {stages} stage{'s' if stages > 1 else ''} x {replicas} data-parallel replicas: the "
            f"dataset gives {fit.micro_batches} full micro-batches an epoch, {fit.micro_batches // replicas} per "
            f"replica, fewer than gradient_accumulation_steps = {fit.gas} (more data or a smaller micro-batch would "
            "allow it)"
        )
    if not fit.fits:
        big = max(fit.plan.stages, key=stage_peak)
        lines.append(
            f"  does not fit: the smallest plan ({fit.choice.describe()}) needs {gib(fit.peak)} on stage {big.stage}, "
            f"{gib(fit.shortfall)} more than {gib(fit.budget)} (shortfall {fit.shortfall / GiB:.2f} GB); "
            "more GPUs (--gpus), a smaller micro-batch or resolution, or a larger GPU"
        )
        return lines
    replicas = fit.gpus // fit.choice.stages
    dp = f", {replicas} data-parallel replica{'s' if replicas > 1 else ''}" if fit.gpus > 1 else ""
    lines += [
        f"  fits: {fit.choice.describe()}{dp}; estimated peak per GPU {peaks} "
        f"(step time x{fit.cost:.2f} of one stage without savers, estimated)",
        "  run.toml fragment (merge into the run config; its keys replace the config's):",
    ]
    lines += ["    " + line if line else "" for line in fragment(fit).splitlines()]
    return lines


def merge_fragment(config_text: str, fragment_text: str) -> str:
    """The run config ``config_text`` with ``fragment_text``'s keys merged in (a fragment's key replaces the config's,
    its tables merge into the config's), written back as TOML (comments are not kept)."""
    import tomllib

    from diffpipe_core.anchor.keys import toml_key, toml_value

    merged = tomllib.loads(config_text)
    for key, value in tomllib.loads(fragment_text).items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    tables = {k: v for k, v in merged.items() if isinstance(v, dict)}
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in merged.items() if k not in tables]
    for name, table in tables.items():
        lines += ["", f"[{toml_key(name)}]", *(f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"
