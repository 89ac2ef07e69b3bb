"""The cost model the ``memory`` partition balances (engine/stage_costs.py, activations.py, meta_forward.py) and the
stage plan (engine/stage_plan.py, plan_build.py), in-process on the reference model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from diffpipe_core.adapters import apply_lora, lora_config
from diffpipe_core.config import RunConfig, load_config
from diffpipe_core.data.cache import open_cached, prepare_cache
from diffpipe_core.engine.activations import LayerTensors, measure_layers
from diffpipe_core.engine.meta_forward import MetaWithRealIntegers
from diffpipe_core.engine.model_loading import cast_skeleton, load_for_stages, materialise_layers
from diffpipe_core.engine.partition import stage_parts
from diffpipe_core.engine.plan_build import example_inputs, make_plan
from diffpipe_core.engine.stage_costs import LayerCost, ModelCosts, layer_costs, meta_twin
from diffpipe_core.engine.stage_plan import (
    HEAP_FRACTION,
    HEAP_PER_WORKER,
    format_plan,
    heap_overhead,
    in_flight_note,
    plan_stages,
)
from diffpipe_core.quantize import quantize_stage
from diffpipe_core.registry import get_registry
from diffpipe_core.testing.activations import check_meta_activations
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_reference.model import TinyDiTConfig, write_tiny_model

RUN = """
output_dir = "out"
dataset = "dataset.toml"
micro_batch_size_per_gpu = 2
pipeline_stages = {stages}
{extra}
[model]
type = "reference"
path = "model"
dtype = "bfloat16"
{model}
[adapter]
rank = 4
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reference model (width 128, 6 blocks), two 64x64 and one 128x64 images, cached."""
    root = tmp_path_factory.mktemp("stage_costs")
    write_tiny_model(root / "model", TinyDiTConfig(dim=128, depth=6, heads=4))
    write_image_dataset(root / "images", 3, size=[(64, 64), (64, 64), (128, 64)])
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[64, 128], enable_ar_bucket=True)
    (root / "run.toml").write_text(RUN.format(stages=2, extra="", model=""))
    cfg = load_config(root / "run.toml", get_registry())
    prepare_cache(root / "dataset.toml", get_registry().model("reference"), cfg.model, progress=False)
    return root


def configured(root: Path, stages: int = 2, extra: str = "", model: str = ""):
    (root / "custom.toml").write_text(RUN.format(stages=stages, extra=extra, model=model))
    cfg = load_config(root / "custom.toml", get_registry())
    return cfg, get_registry().model("reference")


def real_stage(cfg, plugin):
    stage = load_for_stages(plugin, cfg.model, torch.device("cpu"), torch.bfloat16)
    materialise_layers(plugin, cfg.model, stage, range(len(stage.layers)), torch.device("cpu"))
    return stage


def test_meta_forward_keeps_what_a_real_forward_keeps(project: Path) -> None:
    cfg, plugin = configured(project)
    dataset = open_cached(cfg.run.dataset, plugin, cfg.model)
    inputs, label = example_inputs(dataset, plugin, cfg)
    buckets = {dataset.bucket_of(g[0]) for g in dataset.groups()}
    assert len(buckets) > 1 and label == f"micro-batch of 2 in bucket {max(buckets, key=lambda b: b.width * b.height)}"
    stage = real_stage(cfg, plugin)
    costs = layer_costs(cfg, plugin, stage.model, stage.layers, inputs)
    assert costs.measured and costs.failed is None
    # within 1%: CPU layer norms keep their statistics in bf16, the meta kernels in float32; attention keeps
    # what the fused kernels keep (a math-path attention would keep the probabilities: +11% here)
    pairs = check_meta_activations(
        stage.model, stage.layers, inputs, plugin.require("lora_targets", model_config=cfg.model), tolerance=0.01
    )
    assert [m for _, m in pairs] == [sum(c.tensors.saved.values()) for c in costs.layers]


class ShapeReader(nn.Module):
    """Reads integer values a meta forward would not have: a size grid carried as a tensor, a length mask."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        grid = torch.tensor([x.shape[1] // 2, 2], device=x.device)
        h, w = grid.tolist()
        mask = torch.arange(x.shape[1], device=x.device)[None] < lengths[:, None]
        y = self.proj(x).reshape(x.shape[0], h, w, 8) * mask.reshape(x.shape[0], h, w, 1)
        return torch.nn.functional.scaled_dot_product_attention(y, y, y)


def test_meta_forward_keeps_integer_tensors_real() -> None:
    with torch.device("meta"):
        layer = ShapeReader()
    x = torch.empty(3, 6, 8, device="meta", requires_grad=True)
    with MetaWithRealIntegers():
        out = layer(x, torch.tensor([6, 4, 2]))
    assert out.device.type == "meta" and out.shape == (3, 3, 2, 8)
    with pytest.raises(NotImplementedError):  # what the mode makes work
        layer(x, torch.tensor([6, 4, 2]).to("meta"))


def test_a_layer_that_fails_on_meta_borrows_a_like_layers_figures() -> None:
    class Lin(nn.Module):  # a pipeline layer: a tuple of tensors in and out
        def __init__(self, reads: bool = False) -> None:
            super().__init__()
            self.lin, self.reads = nn.Linear(4, 4), reads

        def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            (x,) = inputs
            if self.reads:  # a data-dependent shape: nothing the meta device can know
                x = x[: int(x.sum().item()) % 3 + 1]
            return (torch.relu(self.lin(x)),)

    class Reads(Lin):
        def __init__(self) -> None:
            super().__init__(reads=True)

    with torch.device("meta"):
        layers = [Lin(), Lin(), Reads(), Lin()]
    m = measure_layers(layers, (torch.randn(2, 4),))
    assert m.failed is not None and m.failed.startswith("layer 2 (Reads)")
    assert [t.measured for t in m.layers] == [True, True, False, False]
    assert m.layers[3].saved and sum(m.layers[3].saved.values()) == sum(m.layers[1].saved.values())
    assert not m.layers[2].saved  # no like layer before it


def layer_bytes(layer: nn.Module) -> int:
    """What a layer holds: every tensor of its modules' state (quantized weights' scales included; not the
    serialized description bitsandbytes adds to a state dict)."""
    state = layer.state_dict()
    return sum(t.numel() * t.element_size() for k, t in state.items() if "quant_state." not in k and torch.is_tensor(t))


@pytest.mark.parametrize("mode", [None, "nf4", "int8", "float8"])
def test_weight_bytes_are_what_the_loaded_stage_holds(project: Path, mode: str | None) -> None:
    cfg, plugin = configured(project, model=f'quantize = "{mode}"' if mode else "")
    stage = real_stage(cfg, plugin)
    costs = layer_costs(cfg, plugin, stage.model, stage.layers)
    plain = layer_costs(configured(project)[0], plugin, stage.model, stage.layers)
    quantize_stage(cfg.model, stage, range(len(stage.layers)), plugin.spec.block_layers)
    for i, layer in enumerate(stage.layers):
        real = layer_bytes(layer)
        assert abs(costs.layers[i].weight_bytes - real) <= 0.002 * real + 512, (mode, i, real, costs.layers[i])
    if mode:  # a block's linears: bf16 -> at most about one byte a weight
        assert costs.layers[1].weight_bytes < 0.6 * plain.layers[1].weight_bytes


def test_float32_kept_modules_count_as_float32(project: Path) -> None:
    cfg, plugin = configured(project)
    stage = load_for_stages(plugin, cfg.model, torch.device("meta"), torch.bfloat16)
    model = stage.model
    model._keep_in_fp32_modules = ["modulation"]  # as diffusers models declare it; cast_skeleton honours it
    cast_skeleton(model, torch.bfloat16)
    costs = layer_costs(cfg, plugin, model, stage.layers)
    held = {id(t): t for layer in stage.layers for t in [*layer.parameters(), *layer.buffers()]}
    assert any(t.dtype == torch.float32 for t in held.values())
    assert sum(c.weight_bytes for c in costs.layers) == sum(t.numel() * t.element_size() for t in held.values())


def test_swapped_blocks_count_as_host_memory_on_a_gpu(project: Path) -> None:
    cfg, plugin = configured(project, extra="blocks_to_swap = 2")
    stage = load_for_stages(plugin, cfg.model, torch.device("meta"), torch.bfloat16)
    gpu = make_plan(cfg, plugin, stage.model, stage.layers, on_gpu=True)
    cpu = make_plan(cfg, plugin, stage.model, stage.layers, on_gpu=False)
    block = [c for c in layer_costs(cfg, plugin, stage.model, stage.layers).layers if c.block][0]
    assert block.swappable_bytes == block.weight_bytes > 0  # a block's weights are all frozen and unquantized
    for s in gpu.stages:
        assert s.host_bytes == 2 * block.swappable_bytes
    assert [s.host_bytes for s in cpu.stages] == [0, 0]  # host memory is the device's: nothing moves
    assert sum(s.weight_bytes for s in gpu.stages) == sum(s.weight_bytes for s in cpu.stages) - 4 * block.weight_bytes


def test_trainable_state_counts_lora_weights_gradients_and_adamw_moments(project: Path) -> None:
    cfg, plugin = configured(project)
    stage = load_for_stages(plugin, cfg.model, torch.device("meta"), torch.bfloat16)
    costs = layer_costs(cfg, plugin, stage.model, stage.layers)
    twin, _ = meta_twin(stage.model, stage.layers)
    apply_lora(twin, lora_config(4, 4, 0.0, plugin.require("lora_targets", model_config=cfg.model)))
    lora = sum(p.numel() for n, p in twin.named_parameters() if "lora_" in n)
    assert sum(c.trainable for c in costs.layers) == lora
    assert sum(c.state_bytes for c in costs.layers) == lora * 4 * 4  # float32 weight, gradient, two moments


@pytest.mark.parametrize(
    "table", ['type = "lokr"\nrank = 1000000', 'type = "lokr"\nrank = 8\nfactor = 4', 'type = "loha"\nrank = 4']
)
def test_trainable_state_counts_each_adapter_kinds_own_tensors(project: Path, table: str) -> None:
    """Issue 37.10: a LoKr/LoHa is counted as what peft makes of it on the loaded model, not as a LoRA of its rank
    (a LoKr's rank only caps its decomposed factor: 10^6 keeps both factors whole)."""
    from diffpipe_core.adapter_kinds import from_adapter_table, is_adapter_param
    from diffpipe_core.adapters import apply_adapter

    (project / "custom.toml").write_text(RUN.format(stages=2, extra="", model="").replace("rank = 4", table))
    cfg, plugin = load_config(project / "custom.toml", get_registry()), get_registry().model("reference")
    stage = real_stage(cfg, plugin)
    costs = layer_costs(cfg, plugin, stage.model, stage.layers)
    targets = plugin.require("lora_targets", model_config=cfg.model)
    apply_adapter(stage.model, from_adapter_table(cfg.run.adapter, list(targets)))
    real = sum(p.numel() for n, p in stage.model.named_parameters() if is_adapter_param(n))
    assert sum(c.trainable for c in costs.layers) == real
    assert sum(c.state_bytes for c in costs.layers) == real * 4 * 4  # float32 weight, gradient, two moments


def test_saving_holds_the_gathered_adapter_on_rank_0_and_each_stages_share_elsewhere(project: Path) -> None:
    cfg, plugin = configured(project, stages=3, extra='save_dtype = "bfloat16"')
    stage = load_for_stages(plugin, cfg.model, torch.device("meta"), torch.bfloat16)
    costs = layer_costs(cfg, plugin, stage.model, stage.layers)
    lora = sum(c.trainable for c in costs.layers)
    assert sum(c.trainable_bytes for c in costs.layers) == 4 * lora  # float32 LoRA weights
    assert sum(c.optimizer_bytes for c in costs.layers) == 8 * lora  # AdamW's two float32 moments
    # a second format (one the reference model does not export, so the run config is edited past validation)
    run = cfg.run.model_copy(update={"adapter": cfg.run.adapter.model_copy(update={"save_formats": ["kohya"]})})
    plan = plan_stages(costs, run, 3, on_gpu=False, activations="-")
    first, *others = plan.stages
    own = [4 * sum(c.trainable for c in costs.layers[s.start : s.stop]) for s in plan.stages]
    # rank 0: its pickled share, the received pickles and their tensors, one bf16 copy per file, kohya's own tensors
    assert first.save_bytes == own[0] + 2 * 4 * lora + 2 * 2 * lora + 4 * lora
    for s, mine in zip(others, own[1:]):
        assert s.save_bytes == max(2 * mine, mine)  # the checkpoint's serialised moments outweigh its pickled share
    assert first.peak_bytes == first.weight_bytes + first.state_bytes + max(
        first.activation_bytes + first.transient_bytes, first.save_bytes
    )
    assert "saving" in format_plan(plan)[1]


def test_methods_and_the_plan(project: Path) -> None:
    assert RunConfig.model_fields["partition_method"].default == "memory"
    cfg, plugin = configured(project, stages=3)
    stage = load_for_stages(plugin, cfg.model, torch.device("meta"), torch.bfloat16)
    dataset = open_cached(cfg.run.dataset, plugin, cfg.model)
    memory = make_plan(cfg, plugin, stage.model, stage.layers, dataset)
    peaks = [s.peak_bytes for s in memory.stages]
    assert memory.method == "memory" and all(s.activation_bytes > 0 for s in memory.stages)
    for method in ("parameters", "uniform"):
        cfg_m, _ = configured(project, stages=3, extra=f'partition_method = "{method}"')
        plan = make_plan(cfg_m, plugin, stage.model, stage.layers, dataset)
        assert plan.parts == stage_parts(stage.layers, 3, method)  # exactly as before
        assert max(s.peak_bytes for s in plan.stages) >= max(peaks)
    cfg_s, _ = configured(project, stages=3, extra="partition_split = [1, 2]")
    explicit = make_plan(cfg_s, plugin, stage.model, stage.layers, dataset)
    assert explicit.parts == [0, 1, 2, 8] and explicit.method == "explicit"
    lines = format_plan(explicit)
    assert lines[0].startswith("stage plan (explicit, 3 stages; activations: micro-batch of 2 in bucket 128x128)")
    assert "0 (EmbedLayer)" in lines[2] and "2-7 (BlockLayer x5, FinalLayer)" in lines[4]
    assert "warning: stage 2 is estimated at" in lines[-1] and "above the mean" in lines[-1]
    assert not any("warning" in line for line in format_plan(memory))
    # the first stage of a 1F1B pipeline holds the most micro-batches
    cfg_g, _ = configured(project, stages=3, extra="gradient_accumulation_steps = 4")
    flights = [s.in_flight for s in make_plan(cfg_g, plugin, stage.model, stage.layers, dataset).stages]
    assert flights == [3, 2, 1]


def test_a_model_that_cannot_be_twinned_is_planned_by_its_weights(project: Path) -> None:
    import threading

    cfg, plugin = configured(project)
    stage = load_for_stages(plugin, cfg.model, torch.device("meta"), torch.bfloat16)
    stage.model.lock = threading.Lock()  # deepcopy (the meta twin) cannot copy it
    plan = make_plan(cfg, plugin, stage.model, stage.layers, open_cached(cfg.run.dataset, plugin, cfg.model))
    assert plan.activations.startswith("not estimated, nor trainable state (TypeError")
    assert plan.parts == stage_parts(stage.layers, 2, "parameters")  # all bf16: bytes balance like parameters
    assert sum(s.weight_bytes for s in plan.stages) == 2 * sum(p.numel() for p in stage.model.parameters())


def chain(weights: list[int], saved: list[int], boundary: int) -> ModelCosts:
    """Layers in a chain: layer k takes tensor k (``boundary`` bytes), keeps ``saved[k]`` bytes of its own for
    backward and hands tensor k + 1 (``boundary`` bytes) on; one trainable parameter each, no optimizer state."""
    return ModelCosts(
        [
            LayerCost(f"L{k}", 1, w, 0, False, 1, 0,
                      LayerTensors(saved={100 + k: s}, inputs={k: boundary}, outputs={k + 1: boundary}))
            for k, (w, s) in enumerate(zip(weights, saved, strict=True))
        ],
        measured=True,
    )  # fmt: skip


def estimates(plan) -> list[tuple[int, int, int, int, int]]:
    return [(s.in_flight, s.weight_bytes, s.activation_bytes, s.transient_bytes, s.peak_bytes) for s in plan.stages]


def test_the_memory_split_and_each_stages_estimate_worked_by_hand() -> None:
    """A stage's peak: weights + in-flight micro-batches x (its input, what its layers keep, its output) + receive
    buffers (input from the stage before, output to the stage after) + its largest layer's kept tensors (scratch).
    In flight on stage s: min(stages - s, gradient_accumulation_steps), so the first stage holds the most."""
    run = RunConfig(model={"type": "chain"}, gradient_accumulation_steps=4)
    # 2 stages: weights 40, 20, 20, 20; each layer keeps 5; 4 bytes cross each boundary. In flight: 2, 1.
    #   [0, 1, 4]: stage 0 = 40 + 2 x (4 + 5 + 4) + 4 + 5 = 75;  stage 1 = 60 + 1 x (4 + 15 + 4) + 4 + 5 = 92
    #   [0, 2, 4]: stage 0 = 60 + 2 x (4 + 10 + 4) + 4 + 5 = 105 (with 1 in flight it would be 87: the best)
    #   [0, 3, 4]: stage 0 = 80 + 2 x (4 + 15 + 4) + 4 + 5 = 135
    plan = plan_stages(chain([40, 20, 20, 20], [5] * 4, 4), run, 2, on_gpu=False, activations="-")
    assert plan.parts == [0, 1, 4]
    assert estimates(plan) == [(2, 40, 2 * 13 + 4, 5, 75), (1, 60, 23 + 4, 5, 92)]
    # 3 stages, gradient_accumulation_steps = 2: in flight 2, 2, 1 (not 3, 2, 1: only 2 micro-batches a step).
    #   [0, 2, 3, 5]: 20 + 2 x 18 + 4 + 5 = 65;  10 + 2 x 13 + 8 + 5 = 49;  30 + 1 x 18 + 4 + 5 = 57 -> 65
    #   [0, 1, 3, 5]: 10 + 2 x 13 + 4 + 5 = 45;  20 + 2 x 18 + 8 + 5 = 69;  57 -> 69
    #   [0, 2, 4, 5]: 65;  20 + 2 x 18 + 8 + 5 = 69;  20 + 1 x 13 + 4 + 5 = 42 -> 69 (others are worse still)
    run = RunConfig(model={"type": "chain"}, gradient_accumulation_steps=2)
    plan = plan_stages(chain([10, 10, 10, 10, 20], [5] * 5, 4), run, 3, on_gpu=False, activations="-")
    assert plan.parts == [0, 2, 3, 5]
    assert estimates(plan) == [(2, 20, 2 * 18 + 4, 5, 65), (2, 10, 2 * 13 + 8, 5, 49), (1, 30, 18 + 4, 5, 57)]


def test_a_stage_input_counts_once_per_micro_batch_whether_its_layers_keep_it_or_not() -> None:
    """DeepSpeed's forward pass runs a stage on a clone of its input buffer and keeps the buffer until the
    micro-batch's backward; ds_patches.release_forward_inputs frees the buffer's data after the forward (issue 46),
    so an input the stage's layers keep for backward (a LoRA'd linear's), or pass on to the next stage unchanged (a
    rotary table), is held once per micro-batch in flight, as one they only read. 2 stages of one layer each, in
    flight 2 and 1."""
    run = RunConfig(model={"type": "chain"}, gradient_accumulation_steps=4, pipeline_stages=2, partition_split=[1])
    keeps = chain([10, 10], [5, 5], 4)
    keeps.layers[0].tensors.saved[0] = 4  # layer 0 keeps its input (tensor 0)
    keeps.layers[1].tensors.outputs[1] = 4  # layer 1 hands its input (tensor 1) on beside its output
    plan = plan_stages(keeps, run, 2, on_gpu=False, activations="-")
    # stage 0: 2 x (input 4 + kept 5 + output 4) + send buffer 4; stage 1: 1 x (4 + 5 + 4) + 4
    assert [s.activation_bytes for s in plan.stages] == [2 * 13 + 4, 13 + 4]
    reads = plan_stages(chain([10, 10], [5, 5], 4), run, 2, on_gpu=False, activations="-")
    assert [s.activation_bytes for s in reads.stages] == [2 * 13 + 4, 13 + 4]


def test_a_cpu_plan_counts_each_workers_heap_beside_what_its_tensors_reach() -> None:
    """Issue 46: a CPU worker's C heap holds the step's allocator slack (per worker) and the bookkeeping of what is
    built (per byte held) beyond the tensors. Worked by hand on the chain of the test above (MiB): stage 0 holds
    40 + 2 x (4 + 5 + 4) + 4 + 5 = 75, stage 1 holds 60 + 23 + 4 + 5 = 92; each peak adds 19 MiB + 4.3% of that.
    The memory split balances what the tensors reach, so it is the same with the overhead; a GPU plan has none."""
    mib = 2**20
    run = RunConfig(model={"type": "chain"}, gradient_accumulation_steps=4)
    costs = chain([40 * mib, 20 * mib, 20 * mib, 20 * mib], [5 * mib] * 4, 4 * mib)
    plain = plan_stages(costs, run, 2, on_gpu=False, activations="-")
    heap = plan_stages(costs, run, 2, on_gpu=False, activations="-", host_heap=True)
    assert heap.parts == plain.parts == [0, 1, 4]
    assert [s.held_bytes for s in heap.stages] == [s.peak_bytes for s in plain.stages] == [75 * mib, 92 * mib]
    assert [s.heap_bytes for s in heap.stages] == [19 * mib + round(0.043 * held * mib) for held in (75, 92)]
    assert [s.peak_bytes for s in heap.stages] == [s.held_bytes + s.heap_bytes for s in heap.stages]
    assert heap_overhead(0) == HEAP_PER_WORKER == 19 * mib and HEAP_FRACTION == 0.043
    assert "peaks with each CPU worker's C heap (19 MiB + 4.3%):" in format_plan(heap)[0]
    assert format_plan(plain)[0] == "stage plan (memory, 2 stages; activations: -):"
    gpu = plan_stages(costs, run, 2, on_gpu=True, activations="-", host_heap=True)  # device memory: no C heap
    assert [s.heap_bytes for s in gpu.stages] == [0, 0] and gpu.parts == plain.parts
    # the 1F1B in-flight note and the imbalance warning still judge what the stages hold, overhead included
    assert heap.imbalance < plain.imbalance


def test_make_plan_counts_the_heap_on_a_cpu_run_unless_mallocs_threshold_is_fixed(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU run's plan (what ``train`` prints and partitions by) counts the heap overhead; a GPU run's does not,
    nor a CPU run with ``MALLOC_MMAP_THRESHOLD_`` fixed (every large tensor its own mapping, returned when freed)."""
    cfg, plugin = configured(project)
    model, layers = _meta_stage(cfg, plugin)
    dataset = open_cached(cfg.run.dataset, plugin, cfg.model)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    cpu = make_plan(cfg, plugin, model, layers, dataset, on_gpu=False)
    assert [s.heap_bytes for s in cpu.stages] == [heap_overhead(s.held_bytes) for s in cpu.stages]
    assert all(s.held_bytes > 0 for s in cpu.stages)
    gpu = make_plan(cfg, plugin, model, layers, dataset, on_gpu=True)
    assert [s.heap_bytes for s in gpu.stages] == [0, 0]
    assert [s.held_bytes for s in gpu.stages] == [s.held_bytes for s in cpu.stages]
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 2**10))
    fixed = make_plan(cfg, plugin, model, layers, dataset, on_gpu=False)
    assert [s.peak_bytes for s in fixed.stages] == [s.held_bytes for s in cpu.stages]


def test_an_offloaded_optimizer_state_leaves_the_device_state_and_stays_in_the_checkpoint(project: Path) -> None:
    cfg, plugin = configured(project)
    plain = layer_costs(cfg, plugin, *_meta_stage(cfg, plugin))
    offloaded_cfg, _ = configured(project, model="[optimizer]\noffload = true")
    offloaded = layer_costs(offloaded_cfg, plugin, *_meta_stage(offloaded_cfg, plugin))
    lora = sum(c.trainable for c in plain.layers)
    assert sum(c.state_bytes for c in plain.layers) - sum(c.state_bytes for c in offloaded.layers) == lora * 4 * 2
    assert [c.optimizer_bytes for c in offloaded.layers] == [c.optimizer_bytes for c in plain.layers]


def _meta_stage(cfg, plugin):
    stage = load_for_stages(plugin, cfg.model, torch.device("meta"), torch.bfloat16)
    return stage.model, stage.layers


def test_optimizer_state_bytes_of_the_plugin_optimizers() -> None:
    from diffpipe_core.engine.stage_costs import optimizer_state_bytes

    n, bf16, f32 = 1000, torch.bfloat16, torch.float32
    assert optimizer_state_bytes("muon", n, f32, ndim=2) == 4 * n  # one momentum buffer
    assert optimizer_state_bytes("muon", n, f32, ndim=1) == 8 * n  # AdamW's two moments
    assert optimizer_state_bytes("adamw_optimi", n, bf16) == 3 * 2 * n  # + the Kahan buffer
    assert optimizer_state_bytes("automagic", n, f32, ndim=2) == 2 * n  # int8 rates and signs; factored moment
    assert optimizer_state_bytes("automagic", n, bf16, ndim=1) == 2 * n + 2 * n + 4 * n


def test_the_plan_says_when_micro_batches_in_flight_make_a_stage_the_largest() -> None:
    """Stage 0 of 2 holds 2 micro-batches (1F1B); the second's activations (its input 4, kept 100, output 4 MiB)
    alone put it far above the mean: the plan says so in one line, naming what lowers it."""
    mib = 2**20
    costs = chain([10 * mib, 10 * mib], [100 * mib, 5 * mib], 4 * mib)
    run = RunConfig(model={"type": "chain"}, gradient_accumulation_steps=4, pipeline_stages=2, partition_split=[1])
    plan = plan_stages(costs, run, 2, on_gpu=False, activations="-")
    first, last = plan.stages
    assert (first.in_flight, first.micro_batch_bytes, first.queued_bytes) == (2, 108 * mib, 108 * mib)
    assert (last.in_flight, last.queued_bytes) == (1, 0)
    note = in_flight_note(plan)
    assert note == (
        "  note: stage 0 holds 2 micro-batches' activations at once (DeepSpeed's 1F1B schedule), 108 MiB more than "
        "one; activation_checkpointing = true (it keeps only each block's input) or more pipeline_stages lower it "
        '(the manual: docs/training.md, "Memory per stage")'
    )
    assert format_plan(plan)[-1] == note
    one_at_a_time = RunConfig(model={"type": "chain"}, gradient_accumulation_steps=1, pipeline_stages=2,
                              partition_split=[1])
    assert in_flight_note(plan_stages(costs, one_at_a_time, 2, on_gpu=False, activations="-")) is None
    # the second micro-batch's 13 MiB are below 10% of the mean peak (about 230 MiB): no note
    heavy = chain([400 * mib, 10 * mib], [5 * mib, 5 * mib], 4 * mib)
    assert in_flight_note(plan_stages(heavy, run, 2, on_gpu=False, activations="-")) is None


# ------------------------------------------------------------------------------------------ issue 42, round two
def _full(project: Path, extra: str = "", model: str = ""):
    text = RUN.format(stages=2, extra=extra, model=model).replace("[adapter]\nrank = 4\n", "")
    (project / "full.toml").write_text(text)
    return load_config(project / "full.toml", get_registry()), get_registry().model("reference")


def _plan(cfg, plugin, dataset=None):
    model, layers = _meta_stage(cfg, plugin)
    return make_plan(cfg, plugin, model, layers, dataset, on_gpu=True)


def test_the_plan_counts_an_ema_on_the_stage_and_one_in_host_memory(project: Path) -> None:
    cfg, plugin = configured(project, extra="partition_split = [4]")
    plain = _plan(cfg, plugin)
    for device in ("stage", "cpu"):
        ema_cfg, _ = configured(project, extra="partition_split = [4]", model=f"[ema]\ndevice = '{device}'")
        ema = _plan(ema_cfg, plugin)
        for a, b in zip(plain.stages, ema.stages, strict=True):
            lora = sum(c.trainable_bytes for c in layer_costs(cfg, plugin, *_meta_stage(cfg, plugin)).layers[
                a.start:a.stop])
            assert lora > 0
            on_stage = device == "stage"
            assert b.state_bytes - a.state_bytes == (lora if on_stage else 0)
            assert b.host_state_bytes - a.host_state_bytes == (0 if on_stage else lora)
    assert "host state" in "\n".join(format_plan(ema))


def test_the_plan_moves_an_offloaded_optimizer_state_to_host_memory(project: Path) -> None:
    cfg, plugin = _full(project, extra="partition_split = [4]")
    plain = _plan(cfg, plugin)
    off_cfg, _ = _full(project, extra="partition_split = [4]", model="[optimizer]\noffload = true")
    off = _plan(off_cfg, plugin)
    costs = layer_costs(cfg, plugin, *_meta_stage(cfg, plugin)).layers
    for a, b in zip(plain.stages, off.stages, strict=True):
        moments = sum(c.optimizer_bytes for c in costs[a.start:a.stop])
        assert moments == 2 * sum(c.trainable_bytes for c in costs[a.start:a.stop])  # AdamW, bf16 weights
        assert a.state_bytes - b.state_bytes == moments and b.host_state_bytes == moments


def test_the_plan_holds_no_gradient_buffer_under_gradient_release(project: Path) -> None:
    cfg, plugin = _full(project, extra="partition_split = [4]\ngradient_accumulation_steps = 1")
    plain = _plan(cfg, plugin)
    rel_cfg, _ = _full(project, extra="partition_split = [4]\ngradient_accumulation_steps = 1",
                       model="[optimizer]\ngradient_release = true")
    released = _plan(rel_cfg, plugin)
    model, layers = _meta_stage(cfg, plugin)
    for a, b, (start, stop) in zip(plain.stages, released.stages, [(0, 4), (4, 8)], strict=True):
        grads = [p for layer in layers[start:stop] for p in layer.parameters() if p.is_floating_point()]
        total = sum(p.numel() * p.element_size() for p in {id(p): p for p in grads}.values())
        largest = max(p.numel() * p.element_size() for p in grads)
        assert a.state_bytes - b.state_bytes == total  # the gradient buffer is gone...
        assert b.transient_bytes - a.transient_bytes == largest  # ...but for the one gradient stepped at a time


def test_the_plan_counts_merging_adapters_at_load(project: Path) -> None:
    (project / "extra.safetensors").write_bytes(b"")
    cfg, plugin = configured(project, extra="partition_split = [4]")
    plain = _plan(cfg, plugin)
    merge_cfg, _ = configured(project, extra="partition_split = [4]",
                              model='merge_adapters = [{ path = "extra.safetensors" }]')
    merged = _plan(merge_cfg, plugin)
    model, layers = _meta_stage(cfg, plugin)
    for a, b, (start, stop) in zip(plain.stages, merged.stages, [(0, 4), (4, 8)], strict=True):
        weights = [p for layer in layers[start:stop] for p in layer.parameters() if p.dim() >= 2]
        biggest = max(weights, key=lambda p: p.numel())
        # the weight in float32, the delta, their sum, and the result in the weight's dtype (bf16)
        assert a.load_bytes == 0 and b.load_bytes == biggest.numel() * (3 * 4 + 2)
        assert b.peak_bytes == max(a.peak_bytes, b.weight_bytes + b.load_bytes)
        assert (b.state_bytes, b.activation_bytes) == (a.state_bytes, a.activation_bytes)


def test_the_plan_keeps_the_extra_passes_outputs_on_the_last_stage(project: Path) -> None:
    import numpy as np

    from diffpipe_core.data.cache import SampleRoles

    extra = "partition_split = [4]\ngradient_accumulation_steps = 3"
    cfg, plugin = configured(project, extra=extra)
    dataset = open_cached(cfg.run.dataset, plugin, cfg.model)
    plain = _plan(cfg, plugin, dataset)
    cfg_cfg, _ = configured(project, extra=extra, model="cfg = 3.0")
    with_cfg = _plan(cfg_cfg, plugin, dataset)
    model, layers = _meta_stage(cfg, plugin)
    costs = layer_costs(cfg, plugin, model, layers, example_inputs(dataset, plugin, cfg)[0])
    last_output = sum(costs.layers[-1].tensors.outputs.values())
    assert last_output > 0
    assert with_cfg.stages[0].activation_bytes == plain.stages[0].activation_bytes
    assert with_cfg.stages[1].activation_bytes - plain.stages[1].activation_bytes == 3 * last_output
    # a regularisation folder toward the base adds its pass; a full fine-tune also keeps its initial weights on the host
    dataset.roles = SampleRoles(np.ones(len(dataset.entries)), np.ones(len(dataset.entries), dtype=bool))
    both = _plan(cfg_cfg, plugin, dataset)
    assert both.stages[1].activation_bytes - plain.stages[1].activation_bytes == 2 * 3 * last_output
    assert all(s.host_state_bytes == 0 for s in both.stages)  # a LoRA's base is the adapter disabled
    full_cfg, _ = _full(project, extra=extra)
    full = _plan(full_cfg, plugin, dataset)
    full_costs = layer_costs(full_cfg, plugin, model, layers).layers
    for s in full.stages:
        assert s.host_state_bytes == sum(c.trainable_bytes for c in full_costs[s.start:s.stop]) > 0


def test_the_plan_doubles_the_micro_batches_under_dop(project: Path) -> None:
    """diff_output_preservation trains each micro-batch's class prompts in the same micro-batch (twice the samples)
    and keeps the class prompts' base outputs on the last stage."""
    import numpy as np

    from diffpipe_core.data.cache import SampleRoles

    extra = "partition_split = [4]\ngradient_accumulation_steps = 3"
    cfg, plugin = configured(project, extra=extra)
    dataset = open_cached(cfg.run.dataset, plugin, cfg.model)
    plain = _plan(cfg, plugin, dataset)
    n = len(dataset.entries)
    dataset.roles = SampleRoles(np.ones(n), np.zeros(n, dtype=bool), np.ones(n, dtype=bool), 1.0)
    dop = _plan(cfg, plugin, dataset)
    model, layers = _meta_stage(cfg, plugin)
    costs = layer_costs(cfg, plugin, model, layers, example_inputs(dataset, plugin, cfg)[0])
    last_output = sum(costs.layers[-1].tensors.outputs.values())
    first, last = dop.stages
    assert first.activation_bytes == 2 * plain.stages[0].activation_bytes
    assert first.transient_bytes == 2 * plain.stages[0].transient_bytes
    assert last.activation_bytes == 2 * plain.stages[1].activation_bytes + 3 * last_output
    assert (first.state_bytes, first.weight_bytes) == (plain.stages[0].state_bytes, plain.stages[0].weight_bytes)
