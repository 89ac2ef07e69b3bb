"""Framework overhead: diffpipe's step time / a plain PyTorch loop's, same model, batch and LoRA, 1 process.

    python bench/overhead.py [--steps 40] [--dim 256] [--depth 6] [--size 256]

Runs `diffpipe train` (1 worker, the real cache, DeepSpeed PipelineEngine) on a synthetic dataset, takes
the median step time (step_seconds) from its metrics.jsonl (after warm-up), then times a plain loop doing the same
forward, backward and AdamW step on the same reference model with the same LoRA and batch size.
Target: ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from diffpipe_core.adapters import apply_lora, lora_config
from diffpipe_core.diffusion import flow_matching_pair, masked_mse, sample_timesteps
from diffpipe_core.engine.run_dir import step_seconds
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_core.testing.processes import run_diffpipe
from diffpipe_reference.model import TinyDiT, TinyDiTConfig, write_tiny_model

TARGETS = ["to_q", "to_k", "to_v", "to_out", "fc1", "fc2"]


def diffpipe_step_times(root: Path, cfg: TinyDiTConfig, args: argparse.Namespace) -> list[float]:
    write_tiny_model(root / "model", cfg)
    write_image_dataset(root / "images", 16, size=(args.size, args.size))
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[args.size])
    (root / "run.toml").write_text(
        f"""
output_dir = "out"
dataset = "dataset.toml"
max_steps = {args.steps}
micro_batch_size_per_gpu = {args.batch}
gradient_accumulation_steps = 1
seed = 1
[model]
type = "reference"
path = "model"
[adapter]
rank = 16
[optimizer]
lr = 1e-4
"""
    )
    result = run_diffpipe(["train", "--config", "run.toml", "--num-procs", "1"], cwd=root, timeout=1800)
    if result.returncode != 0:
        sys.exit(result.output[-3000:])
    return step_seconds(next((root / "out").iterdir()))


def plain_step_times(cfg: TinyDiTConfig, args: argparse.Namespace) -> list[float]:
    torch.manual_seed(0)
    model = TinyDiT(cfg)
    apply_lora(model, lora_config(16, 16, 0.0, TARGETS))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01)
    side = args.size // cfg.vae_factor
    latents = torch.randn(args.batch, cfg.in_channels, side, side)
    text = torch.randn(args.batch, cfg.text_len, cfg.text_dim)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        noise = torch.randn(latents.shape, generator=gen)
        t = sample_timesteps(args.batch, gen)
        x_t, target = flow_matching_pair(latents, noise, t)
        loss = masked_mse(model(x_t, t, text), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    cfg = TinyDiTConfig(dim=args.dim, depth=args.depth, heads=4)
    with tempfile.TemporaryDirectory() as tmp:
        ours = diffpipe_step_times(Path(tmp), cfg, args)[args.warmup :]
    plain = plain_step_times(cfg, args)[args.warmup :]
    a, b = statistics.median(ours), statistics.median(plain)
    tokens = (args.size // cfg.vae_factor // cfg.patch_size) ** 2
    print(f"model: TinyDiT dim={args.dim} depth={args.depth}, {tokens} image tokens, batch {args.batch}, LoRA r=16")
    print(f"diffpipe step (median of {len(ours)}): {a * 1000:.1f} ms")
    print(f"plain PyTorch step (median of {len(plain)}): {b * 1000:.1f} ms")
    print(f"overhead ratio: {a / b:.3f} (target <= 1.10)")


if __name__ == "__main__":
    main()
