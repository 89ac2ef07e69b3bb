"""Framework overhead on HunyuanVideo: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and
LoRA, 1 process.

    python diffpipe_hunyuan/bench/step_time.py [--model hunyuan-video-1.5] [--steps 20] [--warmup 4] [--pairs 3]
        [--smoke]

A small HunyuanVideo (width 128 = 4 heads x 32, 2 double + 4 single blocks, 16-channel latents) is written to
disk in the diffusers layout, with 4 clips of 17 frames at 128x128 (5 x 16 x 16 latents = 320 video tokens after
2x2 patches, plus 32 text tokens). diffpipe trains it with `diffpipe train` (1 worker, the real cache, DeepSpeed's
PipelineEngine); its step times come from metrics.jsonl. The plain loop runs the same forward
(HunyuanVideoTransformer3DModel.forward), backward, gradient clipping and AdamW step on the same transformer with
the same peft LoRA (rank 16 on the plugin's lora_targets). The two sides alternate in pairs (the core's
``diffpipe_core.testing.bench``); the ratio of each pair's medians (after warm-up) is reported as median, range and
IQR. Target: ratio <= 1.10.

``--model hunyuan-video-1.5``: a small HunyuanVideo-1.5 (width 128, 8 double blocks, 16-channel latents, 16x VAE)
on the same clips (5 x 8 x 8 = 320 video tokens, patch 1, plus 32 Qwen and 8 glyph tokens); the plain loop runs
HunyuanVideo15Transformer3DModel.forward with the zero condition channels and no image tokens (text-to-video).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from diffpipe_core.testing import bench
from diffpipe_core.testing.media import write_dataset_toml
from diffpipe_hunyuan import plugin15, testing15
from diffpipe_hunyuan.plugin import plugin
from diffpipe_hunyuan.testing import (
    TinyHunyuanConfig,
    llama_tokenizer,
    template_crop_start,
    write_clip_dataset,
    write_tiny_hunyuan,
)

MODEL = TinyHunyuanConfig(
    num_layers=2, num_single_layers=4, num_attention_heads=4, attention_head_dim=32, rope_axes_dim=(8, 12, 12),
    latent_channels=16, text_dim=64, clip_dim=64
)
PIXELS, FRAMES, TEXT_LEN = 128, 17, 32
LATENT = (MODEL.latent_channels, (FRAMES - 1) // 4 + 1, PIXELS // 8, PIXELS // 8)
MODEL15 = testing15.TinyHunyuan15Config(
    num_layers=8, num_attention_heads=4, attention_head_dim=32, rope_axes_dim=(8, 12, 12), latent_channels=16,
    text_dim=64, glyph_dim=32, image_dim=32, vae_channels=(32,) * 5, target_size=PIXELS,
)
LATENT15 = (MODEL15.latent_channels, (FRAMES - 1) // 4 + 1, PIXELS // 16, PIXELS // 16)
GLYPH_LEN = 8


def encoder_keys(model: str = "hunyuan-video") -> dict:
    """The ``[model]`` keys of the text encoding both sides use (beside type, path and float32)."""
    if model == "hunyuan-video-1.5":
        crop = testing15.template_crop_start(testing15.qwen_tokenizer())
        return {"text_max_length": TEXT_LEN, "text_crop_start": crop, "glyph_max_length": GLYPH_LEN}
    return {"text_max_length": TEXT_LEN, "text_crop_start": template_crop_start(llama_tokenizer())}


def diffpipe_times(root: Path, model_dir: Path, args: argparse.Namespace) -> list[float]:
    """Train with `diffpipe train` in ``root``; the step times from metrics.jsonl."""
    write_clip_dataset(root / "clips", [FRAMES + 1] * 4, ["a red cat walks"] * 4, size=(PIXELS, PIXELS), fps=24)
    write_dataset_toml(root / "dataset.toml", root / "clips", resolutions=[PIXELS], frame_buckets=[FRAMES])
    table = bench.model_table(args.model, path=str(model_dir), **encoder_keys(args.model))
    return bench.train_times(root, args, table, timeout=3600)


def plain_times(model_dir: Path, args: argparse.Namespace) -> list[float]:
    cfg, model = bench.plain_model(plugin, model_dir, encoder_dtype="float32", **encoder_keys())
    latents = torch.randn(args.batch, *LATENT)
    text, pooled = torch.randn(args.batch, TEXT_LEN, MODEL.text_dim), torch.randn(args.batch, MODEL.clip_dim)
    text_mask = torch.ones(args.batch, TEXT_LEN, dtype=torch.long)

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(
            hidden_states=x_t,
            timestep=t * 1000,
            encoder_hidden_states=text,
            encoder_attention_mask=text_mask,
            pooled_projections=pooled,
            guidance=torch.full((args.batch,), 1000.0),
        ).sample

    return bench.plain_step_times(model, plugin.lora_targets(cfg), bench.flow_loss(latents, forward), args.steps)


def plain_times15(model_dir: Path, args: argparse.Namespace) -> list[float]:
    cfg, model = bench.plain_model(plugin15.plugin, model_dir, encoder_dtype="float32", **encoder_keys(args.model))
    b, (c, f, h, w) = args.batch, LATENT15
    latents, condition = torch.randn(b, *LATENT15), torch.zeros(b, c + 1, f, h, w)
    text, text_mask = torch.randn(b, TEXT_LEN, MODEL15.text_dim), torch.ones(b, TEXT_LEN, dtype=torch.long)
    glyph, glyph_mask = torch.zeros(b, GLYPH_LEN, MODEL15.glyph_dim), torch.zeros(b, GLYPH_LEN, dtype=torch.long)

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(
            hidden_states=torch.cat([x_t, condition], dim=1),
            timestep=t * 1000,
            encoder_hidden_states=text,
            encoder_attention_mask=text_mask,
            encoder_hidden_states_2=glyph,
            encoder_attention_mask_2=glyph_mask,
            image_embeds=torch.zeros(b, 0, MODEL15.image_dim),
        ).sample

    targets = plugin15.plugin.lora_targets(cfg)
    return bench.plain_step_times(model, targets, bench.flow_loss(latents, forward), args.steps)


def main() -> None:
    parser = bench.bench_parser(threads=True)
    parser.add_argument("--model", choices=["hunyuan-video", "hunyuan-video-1.5"], default="hunyuan-video")
    args = bench.overhead_args(parser)
    v15 = args.model == "hunyuan-video-1.5"
    pairs = bench.measure_overhead(
        args,
        lambda model_dir: testing15.write_tiny_hunyuan15(model_dir, MODEL15) if v15 else write_tiny_hunyuan(
            model_dir, MODEL
        ),
        lambda root, args: diffpipe_times(root, root / "model", args),
        plain_times15 if v15 else plain_times,
        args.pairs,
        lambda i, a, b: print(bench.pair_line(i, a, b, plain_name="plain"), flush=True),
    )
    if v15:
        tokens = LATENT15[1] * LATENT15[2] * LATENT15[3]
        blocks = "8 double blocks"
        text = f"{TEXT_LEN} + {GLYPH_LEN} glyph"
    else:
        tokens, blocks, text = LATENT[1] * (LATENT[2] // 2) * (LATENT[3] // 2), "2 double + 4 single blocks", TEXT_LEN
    print(
        f"model: {args.model} width 128, {blocks}, {tokens} video + {text} text tokens, batch "
        f"{args.batch}, LoRA r=16, float32, CPU threads {torch.get_num_threads()}; medians of "
        f"{args.steps - args.warmup} steps after {args.warmup} warm-up"
    )
    if not args.smoke:
        print(bench.ratio_report(pairs, "diffpipe / plain step time") + "; target <= 1.10")


if __name__ == "__main__":
    main()
