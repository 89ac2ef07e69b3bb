"""Framework overhead on AuraFlow: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python plugins/diffpipe_auraflow/bench/step_time.py [--steps 20] [--warmup 4] [--batch 1] [--pairs 3] [--smoke]

A tiny-but-not-trivial AuraFlow (width 256 = 4 heads x 64, 2 joint + 4 single blocks, 4-channel latents; 256x256
images = 256 image tokens; 64 UMT5 tokens + 8 register tokens) is written to disk in the diffusers layout. diffpipe
trains it with `diffpipe train` (1 worker, the real cache, DeepSpeed PipelineEngine); its median step time comes from
metrics.jsonl (step_seconds) after warm-up. The plain loop runs the same forward (AuraFlowTransformer2DModel.forward
as AuraFlowPipeline calls it), backward, gradient clipping and AdamW step on the same transformer with the same peft
LoRA (rank 16 on the plugin's lora_targets). The two sides alternate for --pairs pairs (which goes first swaps every
pair); the median of the per-pair ratios is printed with its spread. Target: ratio <= 1.10. The shared skeleton is
in ``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_auraflow.plugin import plugin
from diffpipe_auraflow.testing import TinyAuraFlowConfig, write_tiny_auraflow
from diffpipe_core.testing import bench

MODEL = TinyAuraFlowConfig(num_layers=2, num_single_layers=4, num_attention_heads=4, attention_head_dim=64,
                           text_dim=64, pos_embed_max_size=256)
TEXT_LEN, SIZE = 64, 256
MODEL_TABLE = bench.model_table("auraflow", text_max_length=TEXT_LEN)


diffpipe_times = bench.image_trainer(MODEL_TABLE, lambda i: f"a photo of a red cat {i}", SIZE)


def plain_times(model_dir: Path, args) -> list[float]:
    cfg, model = bench.plain_model(plugin, model_dir)
    latents = torch.randn(args.batch, MODEL.latent_channels, SIZE // 8, SIZE // 8)
    text = torch.randn(args.batch, TEXT_LEN, MODEL.text_dim)

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(hidden_states=x_t, encoder_hidden_states=text, timestep=t).sample

    loss = bench.flow_loss(latents, forward, shift=cfg.shift)
    return bench.plain_step_times(model, plugin.lora_targets(model_config=cfg), loss, args.steps)


def main() -> None:
    args = bench.overhead_args(bench.bench_parser())
    write = lambda model_dir: write_tiny_auraflow(model_dir, MODEL)  # noqa: E731
    pairs = bench.measure_overhead(args, write, diffpipe_times, plain_times, args.pairs)
    tokens = (SIZE // 16) ** 2
    print(f"model: AuraFlow width 256, 2 joint + 4 single blocks, {tokens} image + {TEXT_LEN} text tokens, batch "
          f"{args.batch}, LoRA r=16, float32, CPU threads {torch.get_num_threads()}; medians after {args.warmup} "
          "warm-up steps")
    if len(pairs) > 1:
        print(bench.ratio_report(pairs, "overhead ratio") + " (target <= 1.10)")


if __name__ == "__main__":
    main()
