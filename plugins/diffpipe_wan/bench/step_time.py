"""Framework overhead on Wan: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python plugins/diffpipe_wan/bench/step_time.py [--steps 20] [--warmup 4] [--batch 1] [--rounds 3] [--smoke]

A tiny-but-not-trivial Wan 2.1 text-to-video (inner dim 256 = 4 heads x 64, 4 blocks, 16-channel latents; 17-frame
clips at 192x128 = 5 x 16 x 24 latents = 5 x 8 x 12 = 480 video tokens after the 2x2 patches; 64 UMT5 tokens) is
written to disk in the diffusers layout. diffpipe trains it with `diffpipe train` (1 worker, the real cache, DeepSpeed
PipelineEngine); its median step time comes from metrics.jsonl (step_seconds) after warm-up. The plain loop runs the
same forward (WanTransformer3DModel.forward at 1000 t), flow-matching loss, backward, gradient clipping and AdamW
step on the same transformer with the same peft LoRA (rank 16 on the plugin's lora_targets). The two sides
alternate for --rounds pairs (at least 3; which goes first swaps every pair); the median of the per-pair ratios is
printed with its spread. Target: ratio <= 1.10. The shared skeleton is in ``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from diffpipe_core.testing import bench
from diffpipe_wan.plugin import wan
from diffpipe_wan.testing import TinyWanConfig, write_clips, write_tiny_wan

MODEL = TinyWanConfig(
    num_layers=4, num_attention_heads=4, attention_head_dim=64, latent_channels=16, text_dim=64, ffn_dim=512
)
TEXT_LEN, FRAMES, WIDTH, HEIGHT = 64, 17, 192, 128
LATENT = (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8
MODEL_TABLE = bench.model_table("wan", text_max_length=TEXT_LEN)


diffpipe_times = bench.clip_trainer(write_clips, FRAMES, WIDTH, HEIGHT, MODEL_TABLE)


def plain_times(model_dir: Path, args: argparse.Namespace) -> list[float]:
    cfg, model = bench.plain_model(wan, model_dir)
    latents = torch.randn(args.batch, MODEL.latent_channels, *LATENT)
    text = torch.randn(args.batch, TEXT_LEN, MODEL.text_dim)

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(hidden_states=x_t, timestep=t * 1000, encoder_hidden_states=text).sample.float()

    loss = bench.flow_loss(latents, forward)
    return bench.plain_step_times(model, wan.lora_targets(model_config=cfg), loss, args.steps)


def main() -> None:
    args = bench.overhead_args(bench.bench_parser(pairs="--rounds", threads=True))
    write = lambda model_dir: write_tiny_wan(model_dir, MODEL)  # noqa: E731
    pairs = bench.measure_overhead(args, write, diffpipe_times, plain_times, args.rounds, label="round")
    f, h, w = LATENT
    tokens = f"{f}x{h // 2}x{w // 2} = {f * h * w // 4} video + {TEXT_LEN} text tokens"
    print(bench.setup_line(f"Wan inner dim 256, 4 blocks, {tokens}", args))
    print(bench.ratio_line(pairs))


if __name__ == "__main__":
    main()
