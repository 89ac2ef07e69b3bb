"""Framework overhead on Z-Image: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python plugins/diffpipe_zimage/bench/step_time.py [--steps 20] [--warmup 4] [--batch 1] [--pairs 3] [--smoke]

A tiny-but-not-trivial Z-Image (dim 256 = 4 heads x 64, 4 main + 2x2 refiner blocks, 16-channel latents; 256x256
images = 256 image tokens; 64 Qwen3 tokens) is written to disk in the diffusers layout. diffpipe trains it with
`diffpipe train` (1 worker, the real cache, DeepSpeed PipelineEngine); its median step time comes from metrics.jsonl
(step_seconds) after warm-up. The plain loop runs the same forward (ZImageTransformer2DModel.forward on the list
inputs ZImagePipeline gives it), backward, gradient clipping and AdamW step on the same transformer with the same
peft LoRA (rank 16 on the plugin's lora_targets). The two sides alternate for --pairs pairs (which goes first swaps
every pair); the median of the per-pair ratios is printed with its spread. Target: ratio <= 1.10. The shared
skeleton is in ``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing import bench
from diffpipe_zimage.plugin import plugin
from diffpipe_zimage.testing import TinyZImageConfig, write_tiny_zimage

MODEL = TinyZImageConfig(dim=256, n_layers=4, n_heads=4, axes_dims=(16, 24, 24), latent_channels=16, text_dim=64)
TEXT_LEN, SIZE = 64, 256
MODEL_TABLE = bench.model_table("z-image", text_max_length=TEXT_LEN)


diffpipe_times = bench.image_trainer(MODEL_TABLE, lambda i: f"a photo of a red cat {i}", SIZE)


def plain_times(model_dir: Path, args) -> list[float]:
    cfg, model = bench.plain_model(plugin, model_dir)
    latents = torch.randn(args.batch, MODEL.latent_channels, SIZE // 8, SIZE // 8)
    text = [torch.randn(TEXT_LEN // 4, MODEL.text_dim) for _ in range(args.batch)]

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return -torch.stack(model(list(x_t.unsqueeze(2)), 1 - t, text).sample).squeeze(2)

    loss = bench.flow_loss(latents, forward, shift=cfg.shift)
    return bench.plain_step_times(model, plugin.lora_targets(model_config=cfg), loss, args.steps)


def main() -> None:
    args = bench.overhead_args(bench.bench_parser())
    write = lambda model_dir: write_tiny_zimage(model_dir, MODEL)  # noqa: E731
    pairs = bench.measure_overhead(args, write, diffpipe_times, plain_times, args.pairs)
    tokens = (SIZE // 16) ** 2
    print(f"model: Z-Image dim 256, 4 + 2x2 blocks, {tokens} image + {TEXT_LEN} text tokens, batch {args.batch}, "
          f"LoRA r=16, float32, CPU threads {torch.get_num_threads()}; medians after {args.warmup} warm-up steps")
    if len(pairs) > 1:
        print(bench.ratio_report(pairs, "overhead ratio") + " (target <= 1.10)")


if __name__ == "__main__":
    main()
