"""Framework overhead: diffpipe's step time / a plain PyTorch loop's, same model, batch and LoRA, 1 process.

    python bench/overhead.py [--pairs 3] [--steps 40] [--dim 256] [--depth 6] [--size 256] [--smoke]

Runs `diffpipe train` (1 worker, the real cache, DeepSpeed PipelineEngine) on a synthetic dataset, takes
the median step time (step_seconds) from its metrics.jsonl (after warm-up), and times a plain loop doing the same
forward, backward and AdamW step on the same reference model with the same LoRA and batch size. The two sides
alternate in pairs (``--pairs``, at least 3; which goes first swaps every pair), so a drifting load on a shared
machine hits both; the result is the median of the per-pair ratios with their spread. Target: ratio <= 1.10.
The shared skeleton is in ``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from diffpipe_core.testing import bench
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_reference.model import TinyDiT, TinyDiTConfig, write_tiny_model

TARGETS = ["to_q", "to_k", "to_v", "to_out", "fc1", "fc2"]


def write_project(root: Path, cfg: TinyDiTConfig, args: argparse.Namespace) -> None:
    write_tiny_model(root / "model", cfg)
    write_image_dataset(root / "images", 16, size=(args.size, args.size))
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[args.size])
    bench.write_run_toml(root, 'type = "reference"\npath = "model"', args.steps, args.batch)


def plain_times(cfg: TinyDiTConfig, args: argparse.Namespace) -> list[float]:
    torch.manual_seed(0)
    model = TinyDiT(cfg)
    side = args.size // cfg.vae_factor
    latents = torch.randn(args.batch, cfg.in_channels, side, side)
    text = torch.randn(args.batch, cfg.text_len, cfg.text_dim)

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(x_t, t, text)

    return bench.plain_step_times(model, TARGETS, bench.flow_loss(latents, forward), args.steps)


def main() -> None:
    parser = bench.bench_parser(steps=40, warmup=5, batch=4, threads=True)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--size", type=int, default=256)
    args = parser.parse_args()
    bench.use_threads(args.threads)
    cfg = TinyDiTConfig(dim=args.dim, depth=args.depth, heads=4)
    tokens = (args.size // cfg.vae_factor // cfg.patch_size) ** 2
    print(f"model: TinyDiT dim={args.dim} depth={args.depth}, {tokens} image tokens, batch {args.batch}, LoRA r=16, "
          f"CPU threads {args.threads}; medians of {args.steps - args.warmup} steps after {args.warmup} warm-up",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        write_project(Path(tmp), cfg, args)
        pairs = bench.compare(
            lambda: bench.after_warmup(bench.diffpipe_step_times(Path(tmp)), args.warmup),
            lambda: bench.after_warmup(plain_times(cfg, args), args.warmup),
            args.pairs,
            lambda i, ours, plain: print(bench.pair_line(i, ours, plain), flush=True),
            args.smoke,
        )
    if not args.smoke:
        print(bench.ratio_report(pairs, "overhead ratio (diffpipe / plain, target <= 1.10)"))


if __name__ == "__main__":
    main()
