"""Framework overhead on Qwen-Image: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python plugins/diffpipe_qwenimage/bench/step_time.py [--steps 20] [--warmup 4] [--batch 1] [--rounds 3] [--smoke]

A tiny-but-not-trivial Qwen-Image (inner dim 256 = 4 heads x 64, 4 blocks, 16-channel latents; 256x256 images =
16 x 16 = 256 image tokens; 64 text tokens) is written to disk in the diffusers layout. diffpipe trains it with
`diffpipe train` (1 worker, the real cache, DeepSpeed PipelineEngine); its median step time comes from metrics.jsonl
(step_seconds) after warm-up. The plain loop runs the same forward (QwenImageTransformer2DModel.forward with the
pipeline's img_shapes and text mask), backward, gradient clipping and AdamW step on the same transformer with the same
peft LoRA (rank 16 on the plugin's lora_targets). The two sides alternate for --rounds pairs (at least 3; which goes
first swaps every pair); the median of the per-pair ratios is printed with its spread. Target: ratio <= 1.10.
The shared skeleton is in ``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.parts.latents import pack_2x2
from diffpipe_core.testing import bench
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_qwenimage.plugin import plugin
from diffpipe_qwenimage.testing import TinyQwenConfig, write_tiny_qwen

MODEL = TinyQwenConfig(num_layers=4, num_attention_heads=4, attention_head_dim=64, axes_dims_rope=(16, 24, 24),
                       latent_channels=16, text_dim=64)
TEXT_LEN, SIZE = 64, 256
MODEL_TABLE = bench.model_table("qwen-image", text_max_length=TEXT_LEN)


def diffpipe_times(root: Path, args, table: str = MODEL_TABLE) -> list[float]:
    """Train with `diffpipe train` in ``root`` (which holds ``model/``; ``table``: the ``[model]`` table, Qwen-Image's
    or Qwen-Image 2.1's) on 4 long-captioned SIZE x SIZE images; step times from metrics.jsonl."""
    captions = [" ".join(["a long caption of a red cat on a house"] * 6) + f" {i}" for i in range(4)]
    write_image_dataset(root / "images", 4, size=(SIZE, SIZE), captions=captions)
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[SIZE], enable_ar_bucket=False)
    return bench.train_times(root, args, table)


def plain_times(model_dir: Path, args) -> list[float]:
    cfg, model = bench.plain_model(plugin, model_dir)
    h = w = SIZE // 8
    latents = torch.randn(args.batch, MODEL.latent_channels, h, w)
    text = torch.randn(args.batch, TEXT_LEN, MODEL.text_dim)
    mask = torch.ones(args.batch, TEXT_LEN, dtype=torch.bool)
    shapes = [[(1, h // 2, w // 2)]] * args.batch

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(hidden_states=pack_2x2(x_t), encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                     timestep=t, img_shapes=shapes).sample

    loss = bench.flow_loss(latents, forward, pack_2x2)
    return bench.plain_step_times(model, plugin.lora_targets(model_config=cfg), loss, args.steps)


def main() -> None:
    args = bench.overhead_args(bench.bench_parser(pairs="--rounds", threads=True))
    write = lambda model_dir: write_tiny_qwen(model_dir, cfg=MODEL)  # noqa: E731
    pairs = bench.measure_overhead(args, write, diffpipe_times, plain_times, args.rounds, label="round")
    tokens = f"{(SIZE // 16) ** 2} image + {TEXT_LEN} text tokens"
    print(bench.setup_line(f"Qwen-Image inner dim 256, 4 blocks, {tokens}", args))
    print(bench.ratio_line(pairs))


if __name__ == "__main__":
    main()
