"""Step time with [ema] and with CFG-augmented training ([model] cfg) against plain training (issue 42).

    python bench/training_methods.py [--rounds 3] [--steps 24] [--dim 192] [--depth 6] [--size 128] [--smoke]

Each round runs `diffpipe train` (1 worker, the real cache, the reference model, LoRA r=16) three times: plain, with
``[ema]`` (decay 0.999 on the stage's device, every step) and with ``[model] cfg = 3`` (one more forward per
micro-batch, on the empty prompt, without gradient), in an order that rotates every round, so a drifting load on
a shared machine hits every side. Each run's median step time after warm-up (metrics.jsonl's step_seconds, the
whole train_batch: the CFG pass included) is divided by the same round's plain run; the result is the median of
those ratios with their spread.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from diffpipe_core.testing import bench
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_reference.model import TinyDiTConfig, write_tiny_model

SIDES = {
    "plain": ("", ""),
    "ema": ("", "\n[ema]\ndecay = 0.999\n"),
    "cfg": ("cfg = 3.0\n", ""),
}


def side_time(root: Path, name: str, args: argparse.Namespace) -> float:
    model_keys, tables = SIDES[name]
    path = bench.write_run_toml(root, f'type = "reference"\npath = "model"\n{model_keys}', args.steps, args.batch)
    path.write_text(path.read_text() + tables)
    return bench.after_warmup(bench.diffpipe_step_times(root), args.warmup)


def main() -> None:
    parser = bench.bench_parser(steps=24, warmup=4, batch=2, pairs="--rounds", threads=True)
    parser.add_argument("--dim", type=int, default=192)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()
    bench.use_threads(args.threads)
    cfg = TinyDiTConfig(dim=args.dim, depth=args.depth, heads=4)
    print(f"model: TinyDiT dim={args.dim} depth={args.depth}, {args.size}px, batch {args.batch}, LoRA r=16, CPU "
          f"threads {args.threads}; medians of {args.steps - args.warmup} steps after {args.warmup} warm-up",
          flush=True)
    rounds = 1 if args.smoke else args.rounds
    if rounds < 3 and not args.smoke:
        raise SystemExit("--rounds: at least 3 rounds are needed for a median and a spread")
    pairs: dict[str, list[tuple[float, float]]] = {"ema": [], "cfg": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_tiny_model(root / "model", cfg)
        write_image_dataset(root / "images", 8, size=(args.size, args.size))
        write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[args.size])
        for r in range(rounds):
            order = list(SIDES)[r % 3:] + list(SIDES)[: r % 3]
            times = {name: side_time(root, name, args) for name in order}
            for name in ("ema", "cfg"):
                pairs[name].append((times[name], times["plain"]))
            print(f"round {r + 1} ({' -> '.join(order)}): " + ", ".join(f"{n} {t * 1000:.1f} ms"
                                                                       for n, t in times.items()), flush=True)
    if not args.smoke:
        print(bench.ratio_report(pairs["ema"], "step time with [ema] / plain"))
        print(bench.ratio_report(pairs["cfg"], "step time with [model] cfg / plain"))


if __name__ == "__main__":
    main()
