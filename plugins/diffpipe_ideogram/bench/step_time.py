"""Framework overhead on Ideogram 4: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python plugins/diffpipe_ideogram/bench/step_time.py [--steps 20] [--warmup 4] [--batch 1] [--rounds 3] [--smoke]

A tiny-but-not-trivial Ideogram 4 (inner dim 256 = 4 heads x 64, 4 blocks, 16-channel VAE latents = 64 token
channels; 256x256 images = 16 x 16 = 256 image tokens; 64 text tokens of 13 tapped layers at width 64) is written to
disk in the diffusers layout. diffpipe trains it with `diffpipe train` (1 worker, the real cache, DeepSpeed
PipelineEngine); its median step time comes from metrics.jsonl after warm-up. The plain loop runs the same forward
(Ideogram4Transformer2DModel.forward on the pipeline's packed sequence: its ids from `_prepare_ids`), backward,
gradient clipping and AdamW step on the same transformer with the same peft LoRA (rank 16 on the plugin's
lora_targets). The two sides alternate for --rounds pairs (at least 3; which goes first swaps every pair); the median
of the per-pair ratios is printed with its spread. Target: ratio <= 1.10. The shared skeleton is in
``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing import bench
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_ideogram.plugin import plugin, tokens
from diffpipe_ideogram.testing import TAPS, TinyIdeogram4Config, write_tiny_ideogram4

MODEL = TinyIdeogram4Config(num_layers=4, num_attention_heads=4, attention_head_dim=64, mrope_section=(6, 5, 5),
                            latent_channels=16, text_dim=64)
TEXT_LEN, SIZE = 64, 256
MODEL_TABLE = bench.model_table("ideogram4", text_max_length=TEXT_LEN)


def diffpipe_times(root: Path, args) -> list[float]:
    """Train with `diffpipe train` in ``root`` (which holds ``model/``) on 4 long-captioned SIZE x SIZE images (each
    caption fills the text length); step times from metrics.jsonl."""
    words = " ".join(["a red cat on a house"] * 7)  # 63 tokens with the chat template
    captions = [f"{words} {i}" for i in range(4)]
    write_image_dataset(root / "images", 4, size=(SIZE, SIZE), captions=captions)
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[SIZE], enable_ar_bucket=False)
    return bench.train_times(root, args, MODEL_TABLE)


def plain_times(model_dir: Path, args) -> list[float]:
    from diffusers import Ideogram4Pipeline

    cfg, model = bench.plain_model(plugin, model_dir)
    h = w = SIZE // 16
    latents = torch.randn(args.batch, 4 * MODEL.latent_channels, h, w)
    pos, seg, ind = Ideogram4Pipeline._prepare_ids([TEXT_LEN] * args.batch, h, w, TEXT_LEN, torch.device("cpu"))
    text = torch.randn(args.batch, TEXT_LEN + h * w, TAPS * MODEL.text_dim) * (ind == 3)[..., None]
    pad = torch.zeros(args.batch, TEXT_LEN, 4 * MODEL.latent_channels)

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = model(hidden_states=torch.cat([pad, tokens(x_t)], dim=1), timestep=1 - t, encoder_hidden_states=text,
                    position_ids=pos, segment_ids=seg, indicator=ind).sample
        return -out[:, TEXT_LEN:]

    loss = bench.flow_loss(latents, forward, tokens)
    return bench.plain_step_times(model, plugin.lora_targets(model_config=cfg), loss, args.steps)


def main() -> None:
    args = bench.overhead_args(bench.bench_parser(pairs="--rounds", threads=True))
    write = lambda model_dir: write_tiny_ideogram4(model_dir, cfg=MODEL)  # noqa: E731
    pairs = bench.measure_overhead(args, write, diffpipe_times, plain_times, args.rounds, label="round")
    image_tokens = f"{(SIZE // 16) ** 2} image + {TEXT_LEN} text tokens"
    print(bench.setup_line(f"Ideogram 4 inner dim 256, 4 blocks, {image_tokens}", args))
    print(bench.ratio_line(pairs))


if __name__ == "__main__":
    main()
