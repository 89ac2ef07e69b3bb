"""Framework overhead on HiDream-I1: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python plugins/diffpipe_hidream/bench/step_time.py [--steps 20] [--warmup 4] [--batch 1] [--pairs 3] [--smoke]

A tiny-but-not-trivial HiDream-like transformer (width 256 = 4 heads x 64, 2 double- and 2 single-stream blocks with
4 routed experts (2 active) and a shared one, 16-channel latents; 256x256 images = 256 image tokens; 64 T5 and 64
Llama tokens per layer) is written to disk in the diffusers layout. diffpipe trains it with `diffpipe train` (1
worker, the real cache, DeepSpeed PipelineEngine); its median step time comes from metrics.jsonl (step_seconds) after
warm-up. The plain loop runs the same forward (HiDreamImageTransformer2DModel.forward in training mode, as
HiDreamImagePipeline calls it, output negated), backward, gradient clipping and AdamW step on the same transformer
with the same peft LoRA (rank 16 on the plugin's lora_targets). The two sides alternate for --pairs pairs (which goes
first swaps every pair); the median of the per-pair ratios is printed with its spread. Target: ratio <= 1.10. The
shared skeleton is in ``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing import bench
from diffpipe_hidream.plugin import plugin
from diffpipe_hidream.testing import TinyHiDreamConfig, write_tiny_hidream

MODEL = TinyHiDreamConfig(num_layers=2, num_single_layers=2, num_attention_heads=4, attention_head_dim=64,
                          latent_channels=16, text_dim=128, llama_dim=128, clip_l_dim=32, clip_g_dim=64,
                          max_resolution=(32, 32))
TEXT_LEN, SIZE = 64, 256
MODEL_TABLE = bench.model_table("hidream", text_max_length=TEXT_LEN)


diffpipe_times = bench.image_trainer(MODEL_TABLE, lambda i: f"a photo of a red cat {i}", SIZE)


def plain_times(model_dir: Path, args) -> list[float]:
    cfg, model = bench.plain_model(plugin, model_dir)
    model.train()  # the MoE feed-forwards' differentiable routing, as in diffpipe's training
    latents = torch.randn(args.batch, MODEL.latent_channels, SIZE // 8, SIZE // 8)
    t5 = torch.randn(args.batch, TEXT_LEN, MODEL.text_dim)
    llama = torch.randn(MODEL.llama_depth, args.batch, TEXT_LEN, MODEL.llama_dim)
    pooled = torch.randn(args.batch, MODEL.clip_l_dim + MODEL.clip_g_dim)

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = model(hidden_states=x_t, timesteps=t * 1000, encoder_hidden_states_t5=t5,
                    encoder_hidden_states_llama3=llama, pooled_embeds=pooled).sample
        if out.shape != x_t.shape:  # training mode: diffusers returns (B, C, tokens, p * p); back to (B, C, H, W)
            b, c, h, w = x_t.shape
            out = out.reshape(b, c, h // 2, w // 2, 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(b, c, h, w)
        return -out

    loss = bench.flow_loss(latents, forward, shift=plugin.training_shift(cfg))
    return bench.plain_step_times(model, plugin.lora_targets(model_config=cfg), loss, args.steps)


def main() -> None:
    args = bench.overhead_args(bench.bench_parser(threads=True))
    write = lambda model_dir: write_tiny_hidream(model_dir, MODEL)  # noqa: E731
    pairs = bench.measure_overhead(args, write, diffpipe_times, plain_times, args.pairs)
    tokens = (SIZE // 16) ** 2
    print(f"model: HiDream width 256, 2 double + 2 single MoE blocks, {tokens} image + {TEXT_LEN} T5 + {TEXT_LEN} "
          f"Llama tokens, batch {args.batch}, LoRA r=16, float32, CPU threads {torch.get_num_threads()}; medians "
          f"after {args.warmup} warm-up steps")
    if len(pairs) > 1:
        print(bench.ratio_report(pairs, "overhead ratio") + " (target <= 1.10)")


if __name__ == "__main__":
    main()
