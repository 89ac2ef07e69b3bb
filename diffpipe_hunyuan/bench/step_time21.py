"""Framework overhead on HunyuanImage-2.1: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and
LoRA, 1 process.

    python diffpipe_hunyuan/bench/step_time21.py [--steps 20] [--warmup 4] [--batch 1] [--rounds 3] [--smoke]

A small HunyuanImage-2.1 (width 128 = 4 heads x 32, 2 double + 4 single blocks, 16-channel latents from an 8x VAE;
128x128 images = 16 x 16 = 256 image tokens, patch 1; 64 Qwen tokens, no quoted text: one masked glyph token) is
written to disk in the diffusers layout. diffpipe trains it with `diffpipe train` (1 worker, the real cache,
DeepSpeed's PipelineEngine); its step times come from metrics.jsonl. The plain loop runs the same forward
(HunyuanImageTransformer2DModel.forward), backward, gradient clipping and AdamW step on the same transformer with the
same peft LoRA (rank 16 on the plugin's lora_targets). The two sides alternate for --rounds pairs; the median of the
per-pair ratios is printed with its spread. Target: ratio <= 1.10.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing import bench
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_hunyuan.image21 import plugin
from diffpipe_hunyuan.testing21 import TinyHunyuanImageConfig, write_tiny_hunyuan_image

MODEL = TinyHunyuanImageConfig(num_layers=2, num_single_layers=4, num_attention_heads=4, attention_head_dim=32,
                               rope_axes_dim=(16, 16), latent_channels=16, text_dim=64, vae_channels=(32,) * 4)
TEXT_LEN, SIZE = 64, 128
MODEL_TABLE = bench.model_table("hunyuan-image-2.1", text_max_length=TEXT_LEN, glyph_max_length=8)


def diffpipe_times(root: Path, args) -> list[float]:
    """Train with `diffpipe train` in ``root`` (which holds ``model/``) on 4 long-captioned SIZE x SIZE images (each
    caption fills the text length); step times from metrics.jsonl."""
    captions = [" ".join(["a long caption of a red cat on a house"] * 12) + f" {i}" for i in range(4)]
    write_image_dataset(root / "images", 4, size=(SIZE, SIZE), captions=captions)
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[SIZE], enable_ar_bucket=False)
    return bench.train_times(root, args, MODEL_TABLE)


def plain_times(model_dir: Path, args) -> list[float]:
    cfg, model = bench.plain_model(plugin, model_dir)
    b, h = args.batch, SIZE // 8
    latents = torch.randn(b, MODEL.latent_channels, h, h)
    text, mask = torch.randn(b, TEXT_LEN, MODEL.text_dim), torch.ones(b, TEXT_LEN, dtype=torch.long)
    glyph, glyph_mask = torch.zeros(b, 1, MODEL.glyph_dim), torch.zeros(b, 1, dtype=torch.long)

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(hidden_states=x_t, timestep=t * 1000, encoder_hidden_states=text, encoder_attention_mask=mask,
                     encoder_hidden_states_2=glyph, encoder_attention_mask_2=glyph_mask).sample

    return bench.plain_step_times(model, plugin.lora_targets(model_config=cfg), bench.flow_loss(latents, forward),
                                  args.steps)


def main() -> None:
    args = bench.overhead_args(bench.bench_parser(pairs="--rounds", threads=True))
    write = lambda model_dir: write_tiny_hunyuan_image(model_dir, cfg=MODEL)  # noqa: E731
    pairs = bench.measure_overhead(args, write, diffpipe_times, plain_times, args.rounds, label="round")
    print(bench.setup_line(f"HunyuanImage-2.1 width 128, 2 double + 4 single blocks, {(SIZE // 8) ** 2} image + "
                           f"{TEXT_LEN} text tokens", args))
    print(bench.ratio_line(pairs))


if __name__ == "__main__":
    main()
