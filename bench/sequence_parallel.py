"""Per-rank activation memory and step time of one training step with ``sequence_parallel`` 1, 2 and 4 (issue 44).

    python bench/sequence_parallel.py [--model wan|hunyuan-video] [--ways 1,2,4] [--rounds 3] [--tokens 3072]
    python bench/sequence_parallel.py --smoke        # about 100 tokens, one round: checks the bench runs

A random-weight transformer of the model type (diffusers' ``WanTransformer3DModel`` or
``HunyuanVideoTransformer3DModel``, 4 blocks, 8 heads of 32, float32) is cut into the plugin's own pipeline layers
(``split_into_layers``) and trained through diffpipe's sequence parallelism
(:func:`diffpipe_core.engine.sequence_parallel.setup`: the block layers' token split and gather, attention through
DeepSpeed's ``DistributedAttention``) on one long clip (``--tokens`` latent tokens: 3 latent frames of a square
grid), in ``N`` gloo processes (``N = 1`` runs the plain model). Each rank counts the bytes autograd keeps for
backward during the forward (every saved tensor's storage once, via ``saved_tensors_hooks``, the weights autograd
also saves left out: the activations the step holds at its peak, independent of the allocator), and times forward +
backward, and the all-to-alls and all-gathers inside it. Reported per ``N``: the largest rank's kept bytes, their
ratio to ``N = 1``'s (targets: <= 0.55 for 2, <= 0.30 for 4), the median step time and the share of it spent in the
collectives (on CPU gloo the all-to-all's cost; 2 cores shared by N processes also slow the compute, so the step time
is not a speed-up claim).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

HEADS, HEAD_DIM, BLOCKS, CHANNELS = 8, 32, 4, 16


class _Spec:
    def __init__(self, name: str, block_layers: tuple[str, ...], tensors: tuple[tuple[int, int], ...]) -> None:
        self.name, self.block_layers, self.sequence_tensors = name, block_layers, tensors


def build(model: str, side: int) -> tuple[list[torch.nn.Module], tuple[torch.Tensor, ...], _Spec]:
    """The model's pipeline layers (float32, every weight trainable) and one micro-batch's first-layer inputs."""
    from diffpipe_core.registry import get_registry

    spec = get_registry().model(model).spec
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, CHANNELS, 9 // 4 + 1, side * 2, side * 2, generator=g)  # 3 latent frames, 2x2 patches
    t = torch.rand(1, generator=g)
    if model == "wan":
        from diffusers import WanTransformer3DModel

        from diffpipe_wan.layers import split_into_layers

        net = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                                    in_channels=CHANNELS, out_channels=CHANNELS, text_dim=64, freq_dim=64,
                                    ffn_dim=4 * HEADS * HEAD_DIM, num_layers=BLOCKS, rope_max_seq_len=1024)
        inputs = (x, t, torch.randn(1, 16, 64, generator=g))
    else:
        from diffusers import HunyuanVideoTransformer3DModel

        from diffpipe_hunyuan.layers import split_into_layers

        net = HunyuanVideoTransformer3DModel(in_channels=CHANNELS, out_channels=CHANNELS, num_attention_heads=HEADS,
                                             attention_head_dim=HEAD_DIM, num_layers=BLOCKS // 2,
                                             num_single_layers=BLOCKS // 2, num_refiner_layers=1, patch_size=2,
                                             patch_size_t=1, text_embed_dim=64, pooled_projection_dim=32,
                                             rope_axes_dim=(8, 12, 12))
        inputs = (x, t, torch.randn(1, 16, 64, generator=g), torch.ones(1, 16, dtype=torch.long),
                  torch.randn(1, 32, generator=g), torch.full((1,), 0.006))
    return split_into_layers(net), inputs, _Spec(model, spec.block_layers, spec.sequence_tensors)


class Timed:
    """Seconds spent in the collectives Ulysses uses (all-to-all, all-gather), summed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("all_to_all_single", "all_gather", "all_to_all"):
            original = getattr(dist, name)

            def timed(*args, _original=original, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0

            setattr(dist, name, timed)


def kept_bytes(step, weights: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``step()`` runs its forward, the
    ``weights`` (saved by every linear for its input's gradient) left out."""
    seen: dict[int, int] = {}
    skip = {w.untyped_storage().data_ptr() for w in weights}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return sum(seen.values())


def worker(model: str, side: int, rounds: int, out: Path) -> None:
    from diffpipe_core.engine.ds_patches import init_distributed
    from diffpipe_core.engine.sequence_parallel import sequence_groups, setup

    torch.set_num_threads(1)
    init_distributed("gloo")  # DeepSpeed's comm (its all-to-all) and torch's process group
    world, rank = dist.get_world_size(), dist.get_rank()
    layers, inputs, spec = build(model, side)
    if world > 1:
        setup(layers, range(len(layers)), spec, world, rank, sequence_groups(1, world, world))
    timer = Timed()

    def step() -> torch.Tensor:
        h = inputs
        for layer in layers:
            h = layer(h)
        return h[0].float().square().mean()

    weights = [p for layer in layers for p in layer.parameters()]
    kept = kept_bytes(step, weights)  # the first step also warms up
    times, comm = [], []
    for _ in range(rounds):
        dist.barrier()
        timer.seconds = 0.0
        t0 = time.perf_counter()
        step().backward()
        times.append(time.perf_counter() - t0)
        comm.append(timer.seconds)
    (out / f"rank{rank}.json").write_text(json.dumps({"kept": kept, "times": times, "comm": comm}))
    dist.barrier()
    dist.destroy_process_group()


def run(model: str, ways: int, side: int, rounds: int) -> dict:
    from diffpipe_core.engine.launcher import free_port, local_rank_env
    from diffpipe_core.testing import processes

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        port = free_port()
        envs = [{**os.environ, **local_rank_env(r, ways, port), "OMP_NUM_THREADS": "1"} for r in range(ways)]
        argv = [sys.executable, __file__, "--worker", model, str(side), str(rounds), str(out)]
        codes = processes.run_ranks(argv, envs, out, timeout=1800)
        if codes != [0] * ways:
            logs = "\n".join((out / f"log{r}.txt").read_text()[-3000:] for r in range(ways))
            raise SystemExit(f"sequence_parallel = {ways} failed: {codes}\n{logs}")
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ways)]
    slowest = [max(r["times"][i] for r in ranks) for i in range(rounds)]
    comm = [max(r["comm"][i] for r in ranks) for i in range(rounds)]
    return {"kept": max(r["kept"] for r in ranks), "step": statistics.median(slowest),
            "comm": statistics.median(comm)}


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        model, side, rounds, out = sys.argv[2:6]
        return worker(model, int(side), int(rounds), Path(out))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="wan", choices=("wan", "hunyuan-video"))
    parser.add_argument("--ways", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=3072, help="latent tokens of the clip: 3 x side^2")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    tokens, rounds = (96, 1) if args.smoke else (args.tokens, args.rounds)
    side = int(round((tokens / 3) ** 0.5))
    print(f"{args.model}: {BLOCKS} blocks, {HEADS} heads x {HEAD_DIM}, one clip of {3 * side * side} tokens "
          f"(3 x {side} x {side}), float32, {rounds} timed step(s)")
    print(f"{'ways':>5}{'kept MiB/rank':>15}{'of 1 way':>10}{'step s':>9}{'in collectives':>16}")
    base = None
    for ways in (int(w) for w in args.ways.split(",")):
        r = run(args.model, ways, side, rounds)
        base = base or r["kept"]
        print(f"{ways:>5}{r['kept'] / 2**20:>15.1f}{r['kept'] / base:>10.2f}{r['step']:>9.3f}"
              f"{r['comm']:>9.3f} ({100 * r['comm'] / r['step']:.0f}%)", flush=True)


if __name__ == "__main__":
    main()
