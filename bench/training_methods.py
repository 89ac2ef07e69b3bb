"""Step time with [ema], CFG-augmented training ([model] cfg), a regularisation folder trained toward the base model
and gradient release against plain training (issue 42).

    python bench/training_methods.py [--rounds 3] [--steps 24] [--dim 192] [--depth 6] [--size 128] [--smoke]
        [--sides plain,ema,cfg,reg,full,release]

``reg``: the dataset's second folder (half the items) is a regularisation folder with ``regularization_target =
"base"`` (one more forward, without gradient, per micro-batch holding its items), against ``plain`` on the same two
folders. ``release``: a full fine-tune with ``[optimizer] gradient_release``, against ``full``, the same full
fine-tune with plain steps.

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
    "reg": ("", ""),
    "full": ("", ""),
    "release": ("", ""),
}
BASELINE = {"ema": "plain", "cfg": "plain", "reg": "plain", "release": "full"}
REG_KEYS = 'regularization = true\nregularization_target = "base"\n'


def write_dataset(root: Path, size: int, reg: bool) -> None:
    """Two folders of 4 images each; the second a regularisation folder toward the base when ``reg``."""
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[size])
    with (root / "dataset.toml").open("a") as f:
        f.write(f'\n[[directory]]\npath = "{root / "reg"}"\n' + (REG_KEYS if reg else ""))


def side_time(root: Path, name: str, args: argparse.Namespace) -> float:
    model_keys, tables = SIDES[name]
    write_dataset(root, args.size, reg=name == "reg")
    path = bench.write_run_toml(root, f'type = "reference"\npath = "model"\n{model_keys}', args.steps, args.batch)
    text = path.read_text() + tables
    if name in ("full", "release"):  # a full fine-tune, every parameter at lr 1e-5
        text = text.replace(f"[adapter]\nrank = {bench.LORA_RANK}\n", "").replace("lr = 1e-4", "lr = 1e-5")
        text += "gradient_release = true\n" if name == "release" else ""
    path.write_text(text)
    return bench.after_warmup(bench.diffpipe_step_times(root), args.warmup)


def main() -> None:
    parser = bench.bench_parser(steps=24, warmup=4, batch=2, pairs="--rounds", threads=True)
    parser.add_argument("--dim", type=int, default=192)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--sides", default=",".join(SIDES), help="which runs each round makes (comma-separated)")
    args = parser.parse_args()
    sides = [s for s in SIDES if s in args.sides.split(",")]
    wanted = [s for s in BASELINE if s in sides and BASELINE[s] in sides]
    bench.use_threads(args.threads)
    cfg = TinyDiTConfig(dim=args.dim, depth=args.depth, heads=4)
    print(f"model: TinyDiT dim={args.dim} depth={args.depth}, {args.size}px, batch {args.batch}, LoRA r=16, CPU "
          f"threads {args.threads}; medians of {args.steps - args.warmup} steps after {args.warmup} warm-up",
          flush=True)
    rounds = 1 if args.smoke else args.rounds
    if rounds < 3 and not args.smoke:
        raise SystemExit("--rounds: at least 3 rounds are needed for a median and a spread")
    pairs: dict[str, list[tuple[float, float]]] = {name: [] for name in wanted}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_tiny_model(root / "model", cfg)
        write_image_dataset(root / "images", 4, size=(args.size, args.size))
        write_image_dataset(root / "reg", 4, size=(args.size, args.size), seed=5)
        for r in range(rounds):
            order = sides[r % len(sides):] + sides[: r % len(sides)]
            times = {name: side_time(root, name, args) for name in order}
            for name in wanted:
                pairs[name].append((times[name], times[BASELINE[name]]))
            print(f"round {r + 1} ({' -> '.join(order)}): " + ", ".join(f"{n} {t * 1000:.1f} ms"
                                                                       for n, t in times.items()), flush=True)
    labels = {"ema": "[ema]", "cfg": "[model] cfg", "reg": "a regularisation folder toward the base",
              "release": "gradient_release (full fine-tune)"}
    if not args.smoke:
        for name in wanted:
            print(bench.ratio_report(pairs[name], f"step time with {labels[name]} / {BASELINE[name]}"))


if __name__ == "__main__":
    main()
