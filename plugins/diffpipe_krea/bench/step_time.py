"""Framework overhead on Krea 2: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python plugins/diffpipe_krea/bench/step_time.py [--steps 20] [--warmup 4] [--batch 1] [--rounds 3] [--smoke]

A tiny-but-not-trivial Krea 2 (inner dim 256 = 4 heads x 64 with 2 KV heads, 4 blocks, 16-channel latents; 256x256
images = 16 x 16 = 256 image tokens; 64 text tokens of 12 tapped layers at width 64) is written to disk in the
diffusers layout. diffpipe trains it with `diffpipe train` (1 worker, the real cache, DeepSpeed PipelineEngine); its
median step time comes from metrics.jsonl after warm-up. The plain loop runs the same forward
(Krea2Transformer2DModel.forward with the pipeline's position ids and text mask), backward, gradient clipping and
AdamW step on the same transformer with the same peft LoRA (rank 16 on the plugin's lora_targets, the text layers
included). The two sides alternate for --rounds pairs (at least 3; which goes first swaps every pair); the median of
the per-pair ratios is printed with its spread. Target: ratio <= 1.10. The shared skeleton is in
``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.parts.latents import pack_2x2
from diffpipe_core.testing import bench
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_krea.plugin import plugin
from diffpipe_krea.testing import SELECT_LAYERS, TinyKrea2Config, write_tiny_krea2

MODEL = TinyKrea2Config(num_layers=4, num_attention_heads=4, num_key_value_heads=2, attention_head_dim=64,
                        axes_dims_rope=(16, 24, 24), latent_channels=16, text_dim=64)
TEXT_LEN, SIZE = 64, 256
MODEL_TABLE = bench.model_table("krea2", text_max_length=TEXT_LEN)


def diffpipe_times(root: Path, args) -> list[float]:
    """Train with `diffpipe train` in ``root`` (which holds ``model/``) on 4 long-captioned SIZE x SIZE images (each
    caption fills the text length); step times from metrics.jsonl."""
    captions = [" ".join(["a long caption of a red cat on a house"] * 12) + f" {i}" for i in range(4)]
    write_image_dataset(root / "images", 4, size=(SIZE, SIZE), captions=captions)
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[SIZE], enable_ar_bucket=False)
    return bench.train_times(root, args, MODEL_TABLE)


def plain_times(model_dir: Path, args) -> list[float]:
    from diffusers import Krea2Pipeline

    cfg, model = bench.plain_model(plugin, model_dir)
    h = w = SIZE // 8
    latents = torch.randn(args.batch, MODEL.latent_channels, h, w)
    text = torch.randn(args.batch, TEXT_LEN, len(SELECT_LAYERS), MODEL.text_dim)
    mask = torch.ones(args.batch, TEXT_LEN, dtype=torch.bool)
    ids = Krea2Pipeline.prepare_position_ids(TEXT_LEN, h // 2, w // 2, torch.device("cpu"))

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(hidden_states=pack_2x2(x_t), encoder_hidden_states=text, timestep=t, position_ids=ids,
                     encoder_attention_mask=mask).sample

    loss = bench.flow_loss(latents, forward, pack_2x2)
    return bench.plain_step_times(model, plugin.lora_targets(model_config=cfg), loss, args.steps)


def main() -> None:
    args = bench.overhead_args(bench.bench_parser(pairs="--rounds", threads=True))
    write = lambda model_dir: write_tiny_krea2(model_dir, cfg=MODEL)  # noqa: E731
    pairs = bench.measure_overhead(args, write, diffpipe_times, plain_times, args.rounds, label="round")
    tokens = f"{(SIZE // 16) ** 2} image + {TEXT_LEN} text tokens"
    print(bench.setup_line(f"Krea 2 inner dim 256, 4 blocks, {tokens}", args))
    print(bench.ratio_line(pairs))


if __name__ == "__main__":
    main()
