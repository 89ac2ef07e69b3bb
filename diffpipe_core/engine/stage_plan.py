"""The stage plan: where the pipeline's stage boundaries fall and what each stage is estimated to hold.

A stage's estimated peak (bytes on its device) is

    weights (minus swapped blocks' frozen weights, which live in host memory on a GPU run)
    + trainable tensors' own bytes, gradients and optimizer state
    + activations: what its layers keep for backward (block inputs only where activation checkpointing is on,
      none on the device with "offload"), its input and output tensors (each once: DeepSpeed runs the forward on a
      clone of its input buffer, whose data ds_patches releases after the forward), times the micro-batches in flight
      there (DeepSpeed's 1F1B schedule: min(stages - stage, gradient_accumulation_steps)), plus one set of receive
      buffers for the boundary tensors and their gradients
    + a transient: the largest single layer's saved activations (its backward's scratch, or its recomputation),
      or, when larger, what saving holds once the step's activations are gone: a checkpoint serialises the
      stage's optimizer state in memory; an adapter save gathers every stage's adapter on rank 0 (the pickled
      copies and the tensors) and converts it to the save dtype once per format, while the other stages hold
      their pickled share; a full fine-tune's save converts the stage's weights to the save dtype

or, when larger, the weights plus what ``[model] merge_adapters`` holds while the stage loads (``load_bytes``); on a
CPU run (``host_heap``), plus what glibc's malloc holds per worker beyond the tensors (``heap_bytes``,
:func:`heap_overhead`). The
last stage also keeps the outputs of the passes without gradient (``[model] cfg``, a regularisation folder toward
the base, ``diff_output_preservation``) for the step's micro-batches; ``diff_output_preservation`` doubles each
micro-batch's activations. Trained state kept in host memory (an offloaded optimizer state, ``[ema] device = "cpu"``,
a full fine-tune's initial weights for a base pass) is ``host_state_bytes``, outside the peak.

``partition_method = "memory"`` chooses the contiguous split that minimises the largest estimated peak (every stage
keeping at least one trainable layer when possible), then, among those, the most even one.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffpipe_core.config import RunConfig
from diffpipe_core.engine.partition import balanced_parts, min_max_parts
from diffpipe_core.engine.stage_costs import DTYPES, ModelCosts

IMBALANCE = 1.10  # warn when the largest stage's estimated peak is above this times the mean

#: What a CPU worker's C heap holds beyond the tensors the plan counts (issue 46), measured by bench/stage_memory.py
#: (users' regime, 64 px, LoRA rank 4) on Flux 0.70 B and Wan 0.65 B with 1, 2 and 4 stages: each stage's peak
#: anonymous RSS less an idle worker's, less the plan's estimate, was 29-80 MiB on 14 stages of 334-1445 MiB estimated.
#: Since every CPU worker returns the heap's free pages before each pipeline instruction (``ds_patches`` patch 12; it
#: had been 46-96 MiB on 21 stages), two parts remain. Per worker: the slack of the instruction at whose middle the
#: peak falls (what its forward or backward frees and glibc keeps for the rest of it). Per byte the stage holds: the
#: heap's and the interpreter's bookkeeping of what is built (2-3% of a stage's weights resident beyond its tensors
#: after the build) and the instruction's slack, which grows with the stage. A least-squares fit over the 14 stages
#: gives 19 MiB per worker + 4.3% of the stage's estimate, every stage then within 0.97-1.02 of measured (0.90-0.95
#: without) over 2 rounds. Neither part is device memory: a GPU plan leaves both out (its own allocator's slack is
#: the 1-2 GB the manual says to leave), as does a CPU run with glibc's threshold fixed (``MALLOC_MMAP_THRESHOLD_``:
#: every large tensor its own mapping, returned when freed).
HEAP_PER_WORKER = 19 * 2**20
HEAP_FRACTION = 0.043


@dataclass
class StageEstimate:
    """One stage of a plan; byte counts are estimates for the device the stage trains on."""

    stage: int
    start: int  # first layer index
    stop: int  # one past the last
    layer_names: list[str]
    params: int
    weight_bytes: int
    host_bytes: int  # swapped blocks' frozen weights (GPU runs)
    state_bytes: int
    activation_bytes: int
    transient_bytes: int
    in_flight: int
    save_bytes: int = 0  # what saving and checkpointing hold at once, after the step
    micro_batch_bytes: int = 0  # one micro-batch's kept activations with its input and output (x in_flight)
    host_state_bytes: int = 0  # trained state in host memory: offloaded optimizer state, [ema] on the cpu, base copy
    load_bytes: int = 0  # merge_adapters: what merging holds beside the weights while the stage loads
    heap_bytes: int = 0  # a CPU worker's C heap beyond the counted tensors (heap_overhead), part of the peak

    @property
    def queued_bytes(self) -> int:
        """The activations of the micro-batches in flight beyond the first (what 1F1B adds on early stages)."""
        return (self.in_flight - 1) * self.micro_batch_bytes

    @property
    def held_bytes(self) -> int:
        """What the stage's tensors reach at once: the peak without the heap's overhead."""
        training = self.weight_bytes + self.state_bytes + max(self.activation_bytes + self.transient_bytes,
                                                              self.save_bytes)
        return max(training, self.weight_bytes + self.load_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.held_bytes + self.heap_bytes


def heap_overhead(held_bytes: int) -> int:
    """What a CPU worker's C heap holds beyond tensors that reach ``held_bytes`` at once: the step's allocator slack
    (per worker) and the bookkeeping of what is held (per byte); see :data:`HEAP_PER_WORKER`."""
    return HEAP_PER_WORKER + round(HEAP_FRACTION * held_bytes)


@dataclass
class StagePlan:
    method: str
    parts: list[int]
    stages: list[StageEstimate]
    activations: str  # what the activation figures cover (or why there are none)

    @property
    def imbalance(self) -> float:
        """The largest stage's estimated peak over the mean (1.0: even)."""
        peaks = [s.peak_bytes for s in self.stages]
        mean = sum(peaks) / len(peaks)
        return max(peaks) / mean if mean else 1.0


class Estimator:
    """Stage estimates for every interval of layers, from per-layer costs (intervals' activation unions are
    tabulated once: O(layers^2))."""

    def __init__(
        self, costs: ModelCosts, run: RunConfig, stages: int, on_gpu: bool, extra_passes: int = 0,
        base_copy: bool = False, batch_factor: int = 1, host_heap: bool = False,
    ) -> None:
        self.costs, self.stages, self.gas = costs.layers, stages, run.gradient_accumulation_steps
        # outputs of the passes without gradient ([model] cfg's unconditional one, the regularisation base pass) the
        # last stage keeps for the step's micro-batches until their loss; a full fine-tune's base copy (host memory)
        self.extra_passes, self.base_copy = extra_passes, base_copy
        self.batch_factor = batch_factor  # diff_output_preservation: each micro-batch trains twice its samples
        ckpt, offload = bool(run.activation_checkpointing), run.activation_checkpointing == "offload"
        names_blocks = any(c.block for c in self.costs)
        checkpointed = [ckpt and (c.block or not names_blocks) for c in self.costs]
        self.swap, self.on_gpu = run.blocks_to_swap, on_gpu
        self.host_heap = host_heap and not on_gpu  # count a CPU worker's heap overhead (heap_overhead)
        self.union, self.transient = _interval_tables(costs, tuple(checkpointed), offload and on_gpu)
        self.prefix = {
            attr: _prefix([getattr(c, attr) for c in self.costs])
            for attr in ("params", "weight_bytes", "state_bytes", "trainable", "trainable_bytes", "optimizer_bytes",
                         "host_state_bytes")
        }
        self.adapter = run.adapter is not None
        self.save_item = DTYPES[run.save_dtype].itemsize
        self.formats = len(dict.fromkeys(["diffusers", *run.adapter.save_formats])) if run.adapter else 0
        self.inputs = [sum(c.tensors.inputs.values()) for c in self.costs]
        self.outputs = [sum(c.tensors.outputs.values()) for c in self.costs]

    def _sum(self, attr: str, i: int, j: int) -> int:
        p = self.prefix[attr]
        return p[j] - p[i]

    def in_flight(self, stage: int) -> int:
        return max(1, min(self.stages - stage, self.gas))

    def swapped_bytes(self, i: int, j: int) -> int:
        """Frozen weights of the stage's last ``blocks_to_swap`` blocks (what block swap keeps in host memory)."""
        if not self.swap:
            return 0
        blocks = [k for k in range(i, j) if self.costs[k].block]
        return sum(self.costs[k].swappable_bytes for k in blocks[len(blocks) - min(self.swap, len(blocks)) :])

    def save_bytes(self, stage: int, i: int, j: int) -> int:
        """What saving holds beside the weights and trainable state (the larger of the checkpoint and the save)."""
        checkpoint = self._sum("optimizer_bytes", i, j)  # torch.save of the optimizer state into memory
        own = self._sum("trainable_bytes", i, j)
        if not self.adapter:
            return max(checkpoint, self._sum("trainable", i, j) * self.save_item)
        if stage > 0:
            return max(checkpoint, own)  # its pickled share of the gather
        n = len(self.costs)
        gathered = self._sum("trainable_bytes", 0, n)  # rank 0 holds the received pickles and their tensors
        # each file converted to the save dtype; each format beyond diffusers' also builds its own tensors first
        converted = self.formats * self._sum("trainable", 0, n) * self.save_item + (self.formats - 1) * gathered
        return max(checkpoint, own + 2 * gathered + converted)

    def estimate(self, stage: int, i: int, j: int) -> StageEstimate:
        host = self.swapped_bytes(i, j) if self.on_gpu else 0
        buffers = (self.inputs[i] if stage > 0 else 0) + (self.outputs[j - 1] if stage < self.stages - 1 else 0)
        # the last stage holds the extra passes' outputs (one micro-batch's samples each) for the step's micro-batches
        kept = self.extra_passes * self.gas * self.outputs[j - 1] if j == len(self.costs) else 0
        flight = self.in_flight(stage)
        host_state = self._sum("host_state_bytes", i, j) + (self._sum("trainable_bytes", i, j) if self.base_copy else 0)
        released = max((c.largest_grad_bytes for c in self.costs[i:j]), default=0)
        est = StageEstimate(
            stage=stage,
            start=i,
            stop=j,
            layer_names=[c.name for c in self.costs[i:j]],
            params=self._sum("params", i, j),
            weight_bytes=self._sum("weight_bytes", i, j) - host,
            host_bytes=host,
            state_bytes=self._sum("state_bytes", i, j),
            activation_bytes=self.batch_factor * (flight * self.union[i][j] + buffers) + kept,
            transient_bytes=self.batch_factor * self.transient[i][j] + released,
            in_flight=flight,
            save_bytes=self.save_bytes(stage, i, j),
            micro_batch_bytes=self.batch_factor * self.union[i][j],
            host_state_bytes=host_state,
            load_bytes=max((c.merge_bytes for c in self.costs[i:j]), default=0),
        )
        if self.host_heap:
            est.heap_bytes = heap_overhead(est.held_bytes)
        return est

    def peak(self, stage: int, i: int, j: int) -> int:
        return self.estimate(stage, i, j).peak_bytes

    def held(self, stage: int, i: int, j: int) -> int:
        """What the stage's tensors reach (the peak without the heap's overhead): what the memory split balances."""
        return self.estimate(stage, i, j).held_bytes

    def trainable(self, i: int, j: int) -> bool:
        return self._sum("trainable", i, j) > 0


def _interval_tables(costs: ModelCosts, checkpointed: tuple[bool, ...], offload: bool) -> tuple[list, list]:
    """Per interval of layers [i, j): the activations one micro-batch keeps there (``union``: each storage once; a
    checkpointed layer keeps its inputs, none on the device with ``offload``; the interval's inputs, and the last
    layer's outputs; each once: DeepSpeed's forward pass runs the stage on a clone of its input buffer, and
    ``ds_patches.release_forward_inputs`` frees the buffer's data after the forward) and the largest single layer's
    backward transient (``transient``). Made once per measurement
    and way of keeping (the GPU-fit planner plans many candidates over one measurement): O(layers^2)."""
    layers = costs.layers
    cache = costs.measurement.tables if costs.measurement is not None else {}
    key = (checkpointed, offload)
    if key in cache:
        return cache[key]
    n = len(layers)
    kept = [({} if offload else c.tensors.inputs) if checkpointed[k] else c.tensors.saved for k, c in enumerate(layers)]
    own = [sum(c.tensors.saved.values()) for c in layers]
    union = [[0] * (n + 1) for _ in range(n + 1)]
    transient = [[0] * (n + 1) for _ in range(n + 1)]
    for i in range(n):
        first = layers[i].tensors.inputs
        running = dict(first)
        total, top = sum(running.values()), 0
        for j in range(i, n):
            for storage, size in kept[j].items():
                if storage not in running:
                    running[storage] = size
                    total += size
            top = max(top, own[j])
            extra = sum(b for storage, b in layers[j].tensors.outputs.items() if storage not in running)
            union[i][j + 1] = total + extra
            transient[i][j + 1] = top
    cache[key] = (union, transient)
    return union, transient


def _prefix(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def plan_stages(
    costs: ModelCosts,
    run: RunConfig,
    stages: int,
    on_gpu: bool,
    activations: str,
    extra_passes: int = 0,
    base_copy: bool = False,
    batch_factor: int = 1,
    host_heap: bool = False,
) -> StagePlan:
    """Stage boundaries by ``run.partition_split`` or ``run.partition_method``, and each stage's estimate.
    ``extra_passes``: passes without gradient whose outputs the last stage keeps per micro-batch (``[model] cfg``,
    a regularisation folder trained toward the base); ``base_copy``: a full fine-tune keeps its initial weights in
    host memory for that base pass; ``batch_factor``: 2 when every micro-batch also trains its samples' class prompts
    (``diff_output_preservation``); ``host_heap``: a CPU run's estimates count its workers' heap overhead
    (:func:`heap_overhead`; the memory split balances what the tensors reach, the same split as without it)."""
    n = len(costs.layers)
    estimator = Estimator(costs, run, stages, on_gpu, extra_passes, base_copy, batch_factor, host_heap)
    method = "explicit" if run.partition_split is not None else run.partition_method
    if run.partition_split is not None:
        if run.partition_split and run.partition_split[-1] >= n:
            raise ValueError(
                f"partition_split {run.partition_split} points past the model's {n} layers (valid: 1..{n - 1})"
            )
        parts = [0, *run.partition_split, n]
    elif method == "memory":
        parts = min_max_parts(n, stages, estimator.held, estimator.trainable)
    else:
        weights = [c.params for c in costs.layers] if method == "parameters" else [1] * n
        parts = balanced_parts([max(w, 1) for w in weights], stages)
    plan = [estimator.estimate(s, parts[s], parts[s + 1]) for s in range(stages)]
    return StagePlan(method, parts, plan, activations)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 or n == 0 else f"{n / 2**10:,.0f} KiB"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _layers(est: StageEstimate) -> str:
    runs: list[list] = []
    for name in est.layer_names:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    kinds = ", ".join(f"{k} x{c}" if c > 1 else k for k, c in runs)
    span = f"{est.start}-{est.stop - 1}" if est.stop - est.start > 1 else f"{est.start}"
    return f"{span} ({kinds})"


def format_plan(plan: StagePlan) -> list[str]:
    """The plan as printed by ``diffpipe validate``, ``diffpipe data`` and the start of ``train``: a header (naming
    the heap overhead a CPU run's peaks include), one line per stage (its peak: weights + trainable + the larger of
    activations and saving, + the heap's overhead), a warning line when
    the largest stage is more than 10% above the mean, and a note when the micro-batches it holds at once are why
    (:func:`in_flight_note`)."""
    n = len(plan.stages)
    lines = [
        f"stage plan ({plan.method}, {n} stage{'s' if n != 1 else ''}; activations: {plan.activations})"
        + (f", peaks with each CPU worker's C heap ({_mib(HEAP_PER_WORKER)} + {100 * HEAP_FRACTION:g}%)"
           if any(s.heap_bytes for s in plan.stages) else "") + ":",
        f"  {'stage':<6}{'params':>10}{'weights':>12}{'trainable':>12}{'activations':>13}{'saving':>10}"
        f"{'peak (est.)':>13}  layers",
    ]
    for s in plan.stages:
        host = f", +{_mib(s.host_bytes)} host" if s.host_bytes else ""
        host += f", +{_mib(s.host_state_bytes)} host state" if s.host_state_bytes else ""
        lines.append(
            f"  {s.stage:<6}{_count(s.params):>10}{_mib(s.weight_bytes):>12}{_mib(s.state_bytes):>12}"
            f"{_mib(s.activation_bytes + s.transient_bytes):>13}{_mib(s.save_bytes):>10}{_mib(s.peak_bytes):>13}  "
            f"{_layers(s)}{host}"
        )
    lines.extend(line for line in (imbalance_warning(plan), in_flight_note(plan)) if line)
    return lines


def in_flight_note(plan: StagePlan) -> str | None:
    """One line when the largest stage stands out because it holds several micro-batches' activations at once
    (DeepSpeed's 1F1B schedule: stage s holds min(stages - s, gradient_accumulation_steps)): those beyond the first
    alone put it more than 10% above the mean. No split can remove them; the line names what does."""
    if len(plan.stages) < 2:
        return None
    big = max(plan.stages, key=lambda s: s.peak_bytes)
    mean = sum(s.peak_bytes for s in plan.stages) / len(plan.stages)
    if big.in_flight < 2 or big.queued_bytes <= (IMBALANCE - 1) * mean:
        return None
    return (
        f"  note: stage {big.stage} holds {big.in_flight} micro-batches' activations at once (DeepSpeed's 1F1B "
        f"schedule), {_mib(big.queued_bytes)} more than one; activation_checkpointing = true (it keeps only each "
        "block's input) or more pipeline_stages lower it (the manual: docs/training.md, \"Memory per stage\")"
    )


def imbalance_warning(plan: StagePlan) -> str | None:
    """A warning when the largest stage's estimated peak is more than 10% above the mean, else None."""
    if len(plan.stages) < 2 or plan.imbalance <= IMBALANCE:
        return None
    big = max(plan.stages, key=lambda s: s.peak_bytes)
    hint = (
        "partition_method = \"memory\" balances estimated peaks"
        if plan.method != "memory"
        else "the layers are too coarse to split more evenly; partition_split sets the boundaries by hand"
    )
    return (
        f"  warning: stage {big.stage} is estimated at {_mib(big.peak_bytes)}, {100 * (plan.imbalance - 1):.0f}% above "
        f"the mean of the stages; {hint}"
    )
