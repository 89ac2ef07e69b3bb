"""Framework overhead on Flux: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python diffpipe_flux/bench/step_time.py [--pairs 3] [--steps 20] [--warmup 4] [--batch 1] [--smoke]

A tiny-but-not-trivial Flux (inner dim 256 = 4 heads x 64, 2 double + 4 single blocks, 16-channel latents
of 64x64 = 1024 packed image tokens, 64 T5 tokens) is written to disk in the diffusers layout. diffpipe
trains it with `diffpipe train` (1 worker, the real cache, DeepSpeed PipelineEngine); the median step time
comes from metrics.jsonl (step_seconds) after warm-up. The plain loop runs the same
forward (FluxTransformer2DModel.forward), backward, gradient clipping and AdamW step on the same
transformer with the same peft LoRA (rank 16 on the plugin's lora_targets). The two sides alternate in pairs
(``--pairs``, at least 3, which goes first swapping every pair); the result is the median of the per-pair ratios
with their spread. Target: ratio <= 1.10.
The shared skeleton is in ``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from diffpipe_core.testing import bench
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_flux.packing import image_ids, pack, text_ids
from diffpipe_flux.plugin import plugin
from diffpipe_flux.testing import TinyFluxConfig, write_tiny_flux

MODEL = TinyFluxConfig(
    num_layers=2, num_single_layers=4, num_attention_heads=4, attention_head_dim=64, axes_dims_rope=(16, 24, 24),
    latent_channels=16, text_dim=64, clip_dim=64
)
T5_LEN, LATENT = 64, 64  # 64x64 latents = 512x512 pixels
MODEL_TABLE = bench.model_table("flux", t5_max_length=T5_LEN)


def write_project(root: Path, args: argparse.Namespace) -> None:
    """The dataset and run.toml in ``root`` (which holds ``model/``)."""
    write_image_dataset(root / "images", 8, size=(LATENT * 8, LATENT * 8))
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[LATENT * 8])
    bench.write_run_toml(root, MODEL_TABLE, args.steps, args.batch)


def diffpipe_times(root: Path, args: argparse.Namespace) -> list[float]:
    """Train with `diffpipe train` in ``root`` (which holds ``model/``); step times from metrics.jsonl."""
    write_project(root, args)
    return bench.diffpipe_step_times(root)


def plain_times(model_dir: Path, args: argparse.Namespace) -> list[float]:
    cfg, model = bench.plain_model(plugin, model_dir)
    latents = torch.randn(args.batch, MODEL.latent_channels, LATENT, LATENT)
    text, pooled = torch.randn(args.batch, T5_LEN, MODEL.text_dim), torch.randn(args.batch, MODEL.clip_dim)
    img, txt = image_ids(LATENT, LATENT).float(), text_ids(T5_LEN).float()

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(
            hidden_states=pack(x_t),
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=t,
            img_ids=img,
            txt_ids=txt,
            guidance=torch.ones(args.batch),
        ).sample

    return bench.plain_step_times(model, plugin.lora_targets(cfg), bench.flow_loss(latents, forward, pack), args.steps)


def main() -> None:
    args = bench.overhead_args(bench.bench_parser(threads=True))
    tokens = f"{(LATENT // 2) ** 2} image + {T5_LEN} text tokens"
    print(bench.setup_line(f"Flux inner dim 256, 2 double + 4 single blocks, {tokens}", args), flush=True)
    write = lambda model_dir: write_tiny_flux(model_dir, MODEL)  # noqa: E731
    pairs = bench.measure_overhead(args, write, diffpipe_times, plain_times, args.pairs)
    if not args.smoke:
        print(bench.ratio_report(pairs, "overhead ratio (diffpipe / plain, target <= 1.10)"))


if __name__ == "__main__":
    main()
