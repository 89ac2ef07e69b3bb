"""Framework overhead on ERNIE-Image: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python plugins/diffpipe_ernie/bench/step_time.py [--steps 20] [--warmup 4] [--batch 1] [--pairs 3] [--smoke]

A tiny-but-not-trivial ERNIE-Image (width 256 = 4 heads x 64, 4 blocks, MLP 768, FLUX.2-type VAE of 4 levels with 16
latent channels = 64 patch channels; 256x256 images = 256 image tokens; 64 Ministral tokens of width 128) is written
to disk in the diffusers layout. diffpipe trains it with `diffpipe train` (1 worker, the real cache, DeepSpeed
PipelineEngine); its median step time comes from metrics.jsonl (step_seconds) after warm-up. The plain loop runs the
same forward (ErnieImageTransformer2DModel.forward as ErnieImagePipeline calls it: timestep = 1000 t, padded text
with its lengths), backward, gradient clipping and AdamW step on the same transformer with the same peft LoRA (rank
16 on the plugin's lora_targets). The two sides alternate for --pairs pairs (which goes first swaps every pair); the
median of the per-pair ratios is printed with its spread. Target: ratio <= 1.10. The shared skeleton is in
``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing import bench
from diffpipe_ernie.plugin import plugin
from diffpipe_ernie.testing import TinyErnieConfig, write_tiny_ernie

MODEL = TinyErnieConfig(hidden_size=256, num_layers=4, num_attention_heads=4, ffn_hidden_size=768,
                        rope_axes_dim=(16, 24, 24), latent_channels=16, vae_channels=(8, 8, 8, 8), text_dim=128)
TEXT_LEN, SIZE = 64, 256
MODEL_TABLE = bench.model_table("ernie-image", text_max_length=TEXT_LEN)


diffpipe_times = bench.image_trainer(MODEL_TABLE, lambda i: f"a photo of a red cat {i}", SIZE)


def plain_times(model_dir: Path, args) -> list[float]:
    cfg, model = bench.plain_model(plugin, model_dir)
    latents = torch.randn(args.batch, 4 * MODEL.latent_channels, SIZE // 16, SIZE // 16)
    text = torch.randn(args.batch, TEXT_LEN // 4, MODEL.text_dim)
    lengths = torch.full((args.batch,), TEXT_LEN // 4)

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(x_t, t * 1000, text, lengths, return_dict=False)[0]

    loss = bench.flow_loss(latents, forward, shift=cfg.shift)
    return bench.plain_step_times(model, plugin.lora_targets(model_config=cfg), loss, args.steps)


def main() -> None:
    args = bench.overhead_args(bench.bench_parser(threads=True))
    write = lambda model_dir: write_tiny_ernie(model_dir, MODEL)  # noqa: E731
    pairs = bench.measure_overhead(args, write, diffpipe_times, plain_times, args.pairs)
    tokens = (SIZE // 16) ** 2
    print(f"model: ERNIE-Image width 256, 4 blocks, {tokens} image + {TEXT_LEN} text tokens, batch {args.batch}, "
          f"LoRA r=16, float32, CPU threads {torch.get_num_threads()}; medians after {args.warmup} warm-up steps")
    if len(pairs) > 1:
        print(bench.ratio_report(pairs, "overhead ratio") + " (target <= 1.10)")


if __name__ == "__main__":
    main()
