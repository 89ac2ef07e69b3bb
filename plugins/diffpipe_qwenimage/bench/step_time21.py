"""Framework overhead on Qwen-Image 2.1: diffpipe's step time / a plain PyTorch loop's, same transformer, batch, LoRA.

    python plugins/diffpipe_qwenimage/bench/step_time21.py [--steps 20] [--warmup 4] [--batch 1] [--rounds 3] [--smoke]

A tiny-but-not-trivial Qwen-Image 2.1 (inner dim 256 = 4 heads x 64, 4 single-stream blocks, 16-channel latents;
256x256 images = 16 x 16 = 256 image tokens; 64 text tokens) is written to disk in the diffusers layout. diffpipe trains
it with `diffpipe train` (1 worker, the real cache, DeepSpeed PipelineEngine); its median step time comes from
metrics.jsonl after warm-up. The plain loop runs the same forward (QwenImage21Transformer2DModel.forward with the
pipeline's img_shapes, image slots and no text padding), backward, gradient clipping and AdamW step on the same
transformer with the same peft LoRA (rank 16 on the plugin's lora_targets). The two sides alternate for --rounds pairs
(at least 3; which goes first swaps every pair); the median of the per-pair ratios is printed with its spread.
Target: ratio <= 1.10. The shared skeleton is in ``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

from pathlib import Path

import step_time  # this folder's Qwen-Image bench (the script's folder is on sys.path)
import torch

from diffpipe_core.testing import bench
from diffpipe_qwenimage.qwen21 import flat, plugin
from diffpipe_qwenimage.testing21 import TinyQwen21Config, write_tiny_qwen21

MODEL = TinyQwen21Config(num_layers=4, num_attention_heads=4, attention_head_dim=64, axes_dims_rope=(16, 24, 24),
                         latent_channels=16, text_dim=64)
TEXT_LEN, SIZE = step_time.TEXT_LEN, step_time.SIZE
MODEL_TABLE = bench.model_table("qwen-image-2.1", text_max_length=TEXT_LEN)


def diffpipe_times(root: Path, args) -> list[float]:
    """Qwen-Image's bench run (``step_time.diffpipe_times``: the same images and captions) of Qwen-Image 2.1."""
    return step_time.diffpipe_times(root, args, MODEL_TABLE)


def plain_times(model_dir: Path, args) -> list[float]:
    cfg, model = bench.plain_model(plugin, model_dir)
    h = w = SIZE // 16
    latents = torch.randn(args.batch, MODEL.latent_channels, h, w)
    text = torch.randn(args.batch, TEXT_LEN, MODEL.text_dim)
    slots = torch.cat([torch.zeros(args.batch, TEXT_LEN, dtype=torch.bool),
                       torch.ones(args.batch, h * w // 4, dtype=torch.bool)], dim=1)
    shapes = [[(1, h, w)]] * args.batch

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(hidden_states=flat(x_t), encoder_hidden_states=text, timestep=t, img_shapes=shapes,
                     img_mask=slots).sample[:, -h * w :]

    loss = bench.flow_loss(latents, forward, flat)
    return bench.plain_step_times(model, plugin.lora_targets(model_config=cfg), loss, args.steps)


def main() -> None:
    args = bench.overhead_args(bench.bench_parser(pairs="--rounds", threads=True))
    write = lambda model_dir: write_tiny_qwen21(model_dir, cfg=MODEL)  # noqa: E731
    pairs = bench.measure_overhead(args, write, diffpipe_times, plain_times, args.rounds, label="round")
    tokens = f"{(SIZE // 16) ** 2} image + {TEXT_LEN} text tokens"
    print(bench.setup_line(f"Qwen-Image 2.1 inner dim 256, 4 blocks, {tokens}", args))
    print(bench.ratio_line(pairs))


if __name__ == "__main__":
    main()
