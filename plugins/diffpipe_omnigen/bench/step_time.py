"""Framework overhead on OmniGen2: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python plugins/diffpipe_omnigen/bench/step_time.py [--steps 20] [--warmup 4] [--batch 1] [--pairs 3] [--threads 1]
                                                       [--smoke]

A tiny-but-not-trivial OmniGen2 (width 256 = 4 heads x 64, 2 key/value heads, 2 refiner blocks of each kind and 6 main
blocks, 16-channel latents; 256x256 images = 256 image tokens; 64 Qwen2.5-VL tokens) is written to disk in the
released layout. diffpipe trains it with `diffpipe train` (1 worker, the real cache, DeepSpeed PipelineEngine); its
median step time comes from metrics.jsonl (step_seconds) after warm-up. The plain loop runs the same forward
(``OmniGen2Transformer2DModel.forward`` as the reference pipeline calls it, on OmniGen2's time, with the caption
mask), backward, gradient clipping and AdamW step on the same transformer with the same peft LoRA (rank 16 on the
plugin's lora_targets). The two sides alternate for --pairs pairs; the median of the per-pair ratios is printed with
its spread. Target: ratio <= 1.10. The shared skeleton is in ``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.diffusion import flux_resolution_shift
from diffpipe_core.testing import bench
from diffpipe_omnigen.plugin import plugin
from diffpipe_omnigen.testing import write_tiny_omnigen2

TRANSFORMER = {"hidden_size": 256, "num_layers": 6, "num_refiner_layers": 2, "num_attention_heads": 4,
               "num_kv_heads": 2, "multiple_of": 64, "axes_dim_rope": (16, 24, 24), "axes_lens": (512, 512, 512),
               "text_feat_dim": 64}
CHANNELS, TEXT_LEN, SIZE = 16, 64, 256
CAPTION = "a photo of a red cat "
MODEL_TABLE = bench.model_table("omnigen2", text_max_length=TEXT_LEN)


diffpipe_times = bench.image_trainer(MODEL_TABLE, lambda i: f"{CAPTION}{i}", SIZE)


def plain_times(model_dir: Path, args) -> list[float]:
    from transformers import AutoTokenizer

    from diffpipe_omnigen.text import chat_prompts

    cfg, model = bench.plain_model(plugin, model_dir)
    latents = torch.randn(args.batch, CHANNELS, SIZE // 8, SIZE // 8)
    text = torch.randn(args.batch, TEXT_LEN, TRANSFORMER["text_feat_dim"])
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir / "processor"))
    tokens = tokenizer(chat_prompts(tokenizer, [f"{CAPTION}0"], cfg.system_prompt)[0])
    mask = torch.zeros(args.batch, TEXT_LEN, dtype=torch.long)
    mask[:, : len(tokens.input_ids)] = 1  # as many real tokens as diffpipe's cached captions have

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return -model(x_t, 1 - t, text, mask)

    shift = flux_resolution_shift((SIZE // 16) ** 2)  # the plugin's default flux_shift
    loss = bench.flow_loss(latents, forward, shift=shift)
    return bench.plain_step_times(model, plugin.lora_targets(model_config=cfg), loss, args.steps)


def main() -> None:
    args = bench.overhead_args(bench.bench_parser(threads=True))
    write = lambda model_dir: write_tiny_omnigen2(model_dir, transformer=TRANSFORMER, latent_channels=CHANNELS)  # noqa: E731
    pairs = bench.measure_overhead(args, write, diffpipe_times, plain_times, args.pairs)
    tokens = (SIZE // 16) ** 2
    print(f"model: OmniGen2 width 256, 2+2(+2 reference) refiner + 6 main blocks, {tokens} image + {TEXT_LEN} text "
          f"tokens, batch {args.batch}, LoRA r=16, float32, CPU threads {torch.get_num_threads()}; medians after "
          f"{args.warmup} warm-up steps")
    if len(pairs) > 1:
        print(bench.ratio_report(pairs, "overhead ratio") + " (target <= 1.10)")


if __name__ == "__main__":
    main()
