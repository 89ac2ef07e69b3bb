"""Framework overhead on SD3: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python plugins/diffpipe_sd3/bench/step_time.py [--steps 20] [--warmup 4] [--batch 1] [--pairs 3] [--smoke]

A tiny-but-not-trivial SD3.5-Medium-like transformer (width 256 = 4 heads x 64, 4 joint blocks, the first with a
second attention, q/k RMS norms, 16-channel latents; 256x256 images = 256 image tokens; 77 CLIP + 64 T5 tokens) is
written to disk in the diffusers layout. diffpipe trains it with `diffpipe train` (1 worker, the real cache,
DeepSpeed PipelineEngine); its median step time comes from metrics.jsonl (step_seconds) after warm-up. The plain loop
runs the same forward (SD3Transformer2DModel.forward as StableDiffusion3Pipeline calls it), backward, gradient
clipping and AdamW step on the same transformer with the same peft LoRA (rank 16 on the plugin's lora_targets). The
two sides alternate for --pairs pairs (which goes first swaps every pair); the median of the per-pair ratios is
printed with its spread. Target: ratio <= 1.10. The shared skeleton is in ``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing import bench
from diffpipe_sd3.plugin import plugin
from diffpipe_sd3.testing import TinySD3Config, write_tiny_sd3

MODEL = TinySD3Config(num_layers=4, num_attention_heads=4, attention_head_dim=64, latent_channels=16, text_dim=128,
                      clip_l_dim=32, clip_g_dim=64)
TEXT_LEN, SIZE = 64, 256
MODEL_TABLE = bench.model_table("sd3", text_max_length=TEXT_LEN)


diffpipe_times = bench.image_trainer(MODEL_TABLE, lambda i: f"a photo of a red cat {i}", SIZE)


def plain_times(model_dir: Path, args) -> list[float]:
    cfg, model = bench.plain_model(plugin, model_dir)
    latents = torch.randn(args.batch, MODEL.latent_channels, SIZE // 8, SIZE // 8)
    text = torch.randn(args.batch, 77 + TEXT_LEN, MODEL.text_dim)
    pooled = torch.randn(args.batch, MODEL.clip_l_dim + MODEL.clip_g_dim)

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(hidden_states=x_t, timestep=t * 1000, encoder_hidden_states=text, pooled_projections=pooled).sample

    loss = bench.flow_loss(latents, forward, shift=cfg.shift)
    return bench.plain_step_times(model, plugin.lora_targets(model_config=cfg), loss, args.steps)


def main() -> None:
    args = bench.overhead_args(bench.bench_parser())
    write = lambda model_dir: write_tiny_sd3(model_dir, MODEL)  # noqa: E731
    pairs = bench.measure_overhead(args, write, diffpipe_times, plain_times, args.pairs)
    tokens = (SIZE // 16) ** 2
    print(f"model: SD3 width 256, 4 joint blocks, {tokens} image + {77 + TEXT_LEN} text tokens, batch {args.batch}, "
          f"LoRA r=16, float32, CPU threads {torch.get_num_threads()}; medians after {args.warmup} warm-up steps")
    if len(pairs) > 1:
        print(bench.ratio_report(pairs, "overhead ratio") + " (target <= 1.10)")


if __name__ == "__main__":
    main()
