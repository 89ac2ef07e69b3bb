"""One rank of a 2-process DeepSpeed (gloo) run for tests/test_ds_patches.py.

Usage: ``python ds_patch_worker.py SCENARIO OUT_DIR`` with MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK and
LOCAL_RANK set. Each rank writes ``OUT_DIR/rank{RANK}.json`` (and ``.pt`` files for tensors); the test
reads them. Every rank builds every layer from the same seed, so weights agree across ranks and runs.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from torch import nn

from diffpipe_core.engine.ds_patches import (
    ExplicitPartitionPipelineModule,
    forward_outputs,
    init_distributed,
    keep_idle_groups_gradless,
    lean_step,
    name_gradless_boundary_tensors,
    release_forward_inputs,
    release_freed_before_instructions,
    skip_single_replica_allreduce,
    wrap_stage_boundaries,
)
from diffpipe_core.engine.memory_report import rss_anon

DIM = 4
MICRO_BATCHES = 2


class Tagged(nn.Linear):
    """A Linear whose weights are all ``tag``, so a rank can tell which global layers it holds."""

    def __init__(self, tag: int) -> None:
        super().__init__(DIM, DIM)
        with torch.no_grad():
            self.weight.fill_(float(tag))
            self.bias.fill_(float(tag))


def unwrap(inputs: Any) -> torch.Tensor:
    """The first stage gets the batch's inputs tuple as is (like the trainer's batches)."""
    return inputs[0] if isinstance(inputs, tuple) else inputs


class FirstLinear(nn.Linear):
    def forward(self, inputs: Any) -> torch.Tensor:
        return super().forward(unwrap(inputs))


class Split(nn.Module):
    """First layer returning several float tensors (like an embedder returning hidden + conditioning)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)

    def forward(self, inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x = unwrap(inputs)
        return torch.tanh(self.a(x)), torch.sigmoid(self.b(x))


class UsesFirst(nn.Module):
    """Takes (h, c) but ignores c: c crosses the stage boundary and never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.lin(inputs[0])


def mse(outputs: torch.Tensor, labels: tuple[torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(outputs, labels[0])


def batches(seed: int = 1) -> list[tuple[tuple[torch.Tensor], tuple[torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(1, DIM, generator=g),), (torch.randn(1, DIM, generator=g),)) for _ in range(MICRO_BATCHES)]


def engine_for(module: PipelineModule) -> Any:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "gradient_clipping": 0.0,  # as the trainer; DeepSpeed's clipping fails on a stage with no gradients
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1), config=config
    )
    return engine


def local_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def scenario_parts(rank: int, out: Path) -> dict[str, Any]:
    module = ExplicitPartitionPipelineModule(
        layers=[Tagged(i) for i in range(4)], parts=[0, 1, 4], num_stages=2, loss_fn=mse, dynamic_shape=True
    )
    return {
        "parts": list(module.parts),
        "local_start": module._local_start,
        "local_stop": module._local_stop,
        "forward_func_tags": [int(f.weight[0, 0].item()) for f in module.forward_funcs],
        "param_count": sum(p.numel() for p in module.parameters()),
    }


def frozen_first_stage_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    frozen = FirstLinear(DIM, DIM).requires_grad_(False)
    return [frozen, nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()), nn.Linear(DIM, DIM)]


def run_frozen_first_stage(rank: int, out: Path, wrap: bool) -> dict[str, Any]:
    parts = [0, 1, 3]
    layers = frozen_first_stage_layers()
    module = ExplicitPartitionPipelineModule(
        layers=wrap_stage_boundaries(layers, parts) if wrap else layers,
        parts=parts,
        num_stages=2,
        loss_fn=mse,
        dynamic_shape=True,
    )
    engine = engine_for(module)
    before = local_state(module)
    loss = engine.train_batch(data_iter=iter(batches()))
    torch.save({"before": before, "after": local_state(module)}, out / f"frozen_first_stage_rank{rank}.pt")
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    return {"loss": float(loss), "trainable": trainable}


def scenario_unused_boundary(rank: int, out: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    parts = [0, 1, 3]
    layers = [Split(), UsesFirst(), nn.Linear(DIM, DIM)]
    module = ExplicitPartitionPipelineModule(
        layers=wrap_stage_boundaries(layers, parts), parts=parts, num_stages=2, loss_fn=mse, dynamic_shape=True
    )
    engine = engine_for(module)
    name_gradless_boundary_tensors(engine, "layer 0 (Split)")
    return {"loss": float(engine.train_batch(data_iter=iter(batches())))}


def scenario_forward(rank: int, out: Path) -> dict[str, Any]:
    """After a training step, a forward-only pass returns each micro-batch's outputs on the last stage."""
    parts = [0, 1, 3]
    module = ExplicitPartitionPipelineModule(
        layers=wrap_stage_boundaries(frozen_first_stage_layers(), parts),
        parts=parts,
        num_stages=2,
        loss_fn=mse,
        dynamic_shape=True,
    )
    engine = engine_for(module)
    engine.train_batch(data_iter=iter(batches()))
    outputs = forward_outputs(engine, iter(batches(seed=2)), MICRO_BATCHES)
    if rank == 0:
        return {"outputs": outputs}
    first = frozen_first_stage_layers()[0]  # frozen: what stage 0 still holds
    with torch.no_grad():
        expected = [module.forward_funcs[1](module.forward_funcs[0](first(x))) for x, _ in batches(seed=2)]
    got = [o[0] if isinstance(o, (list, tuple)) else o for o in outputs]
    return {"max_error": max(float((g - e).abs().max()) for g, e in zip(got, expected)), "count": len(got)}


def count_calls(obj: Any, method: str) -> list[int]:
    """Count ``obj.method``'s calls (it still runs); the returned list grows by one per call."""
    calls: list[int] = []
    original = getattr(obj, method)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    setattr(obj, method, counted)
    return calls


def scenario_single_replica(rank: int, out: Path) -> dict[str, Any]:
    """Two stages, one replica each: the same step with DeepSpeed's all-reduce and with it skipped."""
    result: dict[str, Any] = {}
    for skip in (False, True):
        torch.manual_seed(0)
        parts = [0, 2, 3]
        module = ExplicitPartitionPipelineModule(
            layers=[FirstLinear(DIM, DIM), nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()), nn.Linear(DIM, DIM)],
            parts=parts, num_stages=2, loss_fn=mse, dynamic_shape=True,
        )  # fmt: skip
        engine = engine_for(module)
        skipped = skip_single_replica_allreduce(engine) if skip else False
        calls = count_calls(engine, "buffered_allreduce_fallback")
        loss = float(engine.train_batch(data_iter=iter(batches())))
        state = local_state(module)
        result["skipped" if skip else "reduced"] = {"turned_off": skipped, "allreduce_calls": len(calls), "loss": loss}
        torch.save(state, out / f"single_replica_{'skipped' if skip else 'reduced'}_rank{rank}.pt")
    return result


class Dropped(nn.Module):
    """A linear with dropout: its output depends on the training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(DIM, DIM), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x))


def scenario_lean_step(rank: int, out: Path) -> dict[str, Any]:
    """Three steps with an eval pass between the second and the third, with and without patch 9: the module-tree
    walks each step does, the gradients left after each step, and the weights (dropout draws included)."""
    result: dict[str, Any] = {}
    for lean in (False, True):
        torch.manual_seed(0)
        frozen = FirstLinear(DIM, DIM).requires_grad_(False)
        layers = [frozen, Dropped(), nn.Linear(DIM, DIM)]
        module = ExplicitPartitionPipelineModule(
            layers=wrap_stage_boundaries(layers, [0, 1, 3]), parts=[0, 1, 3], num_stages=2, loss_fn=mse,
            dynamic_shape=True,
        )  # fmt: skip
        engine = engine_for(module)
        skip_single_replica_allreduce(engine)  # its reduction walks named_parameters too
        if lean:
            lean_step(engine)
        params, submodules = list(module.parameters()), list(module.modules())  # before counting the walks
        walks = count_calls(layers[1] if rank == 1 else layers[0], "train")  # a submodule's train(): one walk
        named = count_calls(engine.module, "named_parameters")
        modes, grads = [], []
        for step in range(3):
            if step == 2:
                forward_outputs(engine, iter(batches(seed=5)), MICRO_BATCHES)  # eval_batch: module.eval()
            torch.manual_seed(10 + step)
            engine.train_batch(data_iter=iter(batches(seed=step)))
            modes.append(all(m.training for m in submodules))
            grads.append(sum(p.grad is not None for p in params))
        name = "lean" if lean else "plain"
        result[name] = {"walks": len(walks), "named_parameters": len(named), "modes": modes, "grads": grads}
        torch.save(local_state(module), out / f"lean_step_{name}_rank{rank}.pt")
    return result


class TwoNetworks(nn.Module):
    """Two linears, ``a`` always used and ``b`` only while ``use_b`` (one of two experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.use_b = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), True

    def forward(self, inputs: Any) -> torch.Tensor:
        x = unwrap(inputs)
        return self.a(x) + self.b(x) if self.use_b else self.a(x)


def scenario_idle_group(rank: int, out: Path) -> dict[str, Any]:
    """One stage, two replicas, AdamW with a group per network: a step using both, then one where no replica uses
    ``b``, with and without patch 10: ``b``'s gradient after the reduction and whether the second step moved it."""
    result: dict[str, Any] = {}
    for patched in (False, True):
        torch.manual_seed(0)
        layer = TwoNetworks()
        module = ExplicitPartitionPipelineModule(layers=[layer], parts=[0, 1], num_stages=1, loss_fn=mse,
                                                 dynamic_shape=True)  # fmt: skip
        groups = [list(layer.a.parameters()), list(layer.b.parameters())]
        optimizer = torch.optim.AdamW([{"params": g} for g in groups], lr=0.1)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": MICRO_BATCHES,
                  "gradient_clipping": 0.0, "steps_per_print": 1 << 30}  # fmt: skip
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
        applied = keep_idle_groups_gradless(engine, groups) if patched else False
        engine.train_batch(data_iter=iter(batches(seed=rank)))
        before = layer.b.weight.detach().clone()
        layer.use_b = False
        seen: list[bool] = []  # b has no gradient when the optimizer steps
        step = optimizer.step

        def watched(*args: Any, seen=seen, weight=layer.b.weight, step=step, **kwargs: Any) -> Any:
            seen.append(weight.grad is None)
            return step(*args, **kwargs)

        optimizer.step = watched
        engine.train_batch(data_iter=iter(batches(seed=10 + rank)))
        moved = float((layer.b.weight.detach() - before).abs().max())
        result["patched" if patched else "plain"] = {"applied": applied, "b_grad_none": seen, "b_moved": moved}
    return result


def scenario_release_inputs(rank: int, out: Path) -> dict[str, Any]:
    """Two stages, two micro-batches, with and without patch 11: the bytes each forward pass leaves in the stage's
    input buffer (stage 1's first layer, a Linear, keeps its input for backward), the loss and the weights."""
    from deepspeed.runtime.pipe import schedule

    result: dict[str, Any] = {}
    for patched in (False, True):
        torch.manual_seed(0)
        module = ExplicitPartitionPipelineModule(
            layers=[FirstLinear(DIM, DIM), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM)], parts=[0, 1, 4],
            num_stages=2, loss_fn=mse, dynamic_shape=True,
        )  # fmt: skip
        engine = engine_for(module)
        if patched:
            release_forward_inputs(engine)
        forward, kept = engine._INSTRUCTION_MAP[schedule.ForwardPass], []

        def watched(self: Any, buffer_id: int, forward=forward, kept=kept) -> None:
            forward(self, buffer_id)
            inputs = self.pipe_buffers["inputs"][buffer_id]
            kept.append(sum(t.untyped_storage().nbytes() for t in (inputs if isinstance(inputs, tuple) else (inputs,))
                            if t.is_floating_point()))  # fmt: skip

        engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, schedule.ForwardPass: watched}
        losses = [float(engine.train_batch(data_iter=iter(batches(seed=step)))) for step in range(2)]
        name = "patched" if patched else "plain"
        result[name] = {"kept_bytes": kept, "losses": losses}
        torch.save(local_state(module), out / f"release_inputs_{name}_rank{rank}.pt")
    return result


class HeapHoles(nn.Module):
    """Identity whose first forward leaves 16 MiB of freed 64 KiB chunks in the C heap between chunks it keeps (a
    forward's freed temporaries beside the activations it saves): glibc cannot return them on ``free``."""

    CHUNK = 2**14  # float32 elements: 64 KiB, under glibc's mmap threshold, so from the heap

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kept:
            chunks = [torch.ones(self.CHUNK) for _ in range(512)]  # touched: resident
            self.kept = chunks[1::2]
            del chunks
        return x


def scenario_release_heap(rank: int, out: Path) -> dict[str, Any]:
    """Two stages, with and without patch 12: stage 0's anonymous RSS when the instruction after its first forward
    pass starts (that forward left 16 MiB of heap holes), over its RSS when the forward started; and the losses."""
    result: dict[str, Any] = {}
    for patched in (False, True):
        torch.manual_seed(0)
        module = ExplicitPartitionPipelineModule(
            layers=[FirstLinear(DIM, DIM), HeapHoles(), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)], parts=[0, 2, 4],
            num_stages=2, loss_fn=mse, dynamic_shape=True,
        )  # fmt: skip
        engine = engine_for(module)
        starts: list[tuple[str, int]] = []

        def watched(instruction: Any, name: str, starts: list = starts) -> Any:
            def run(self: Any, *args: Any, **kwargs: Any) -> Any:
                starts.append((name, rss_anon()))
                return instruction(self, *args, **kwargs)

            return run

        engine._INSTRUCTION_MAP = {k: watched(v, k.__name__) for k, v in engine._INSTRUCTION_MAP.items()}
        if patched:
            release_freed_before_instructions(engine)  # wraps the watcher: the heap is released, then measured
        losses = [float(engine.train_batch(data_iter=iter(batches(seed=step)))) for step in range(2)]
        first = next(i for i, (name, _) in enumerate(starts) if name == "ForwardPass")
        result["patched" if patched else "plain"] = {
            "retained": starts[first + 1][1] - starts[first][1], "after": starts[first + 1][0], "losses": losses,
        }  # fmt: skip
    return result


SCENARIOS = {
    "idle_group": scenario_idle_group,
    "parts": scenario_parts,
    "wrapped": lambda rank, out: run_frozen_first_stage(rank, out, wrap=True),
    "unwrapped": lambda rank, out: run_frozen_first_stage(rank, out, wrap=False),
    "unused_boundary": scenario_unused_boundary,
    "forward": scenario_forward,
    "single_replica": scenario_single_replica,
    "lean_step": scenario_lean_step,
    "release_inputs": scenario_release_inputs,
    "release_heap": scenario_release_heap,
}


def main() -> None:
    scenarios, out = sys.argv[1].split(","), Path(sys.argv[2])
    init_distributed("gloo")
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for scenario in scenarios:
        try:
            results[scenario] = SCENARIOS[scenario](rank, out)
        except Exception as e:  # some scenarios are expected to fail: report how
            traceback.print_exc()
            results[scenario] = {"error": f"{type(e).__name__}: {e}"}
        (out / f"rank{rank}.json").write_text(json.dumps(results))
        if "error" in results[scenario]:
            # The other stage may be blocked in a pipeline send/recv that will never complete;
            # leave without the barrier (the test kills what is left).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(3)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
