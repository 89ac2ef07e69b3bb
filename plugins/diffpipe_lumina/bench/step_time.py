"""Framework overhead on Lumina 2: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python plugins/diffpipe_lumina/bench/step_time.py [--steps 20] [--warmup 4] [--batch 1] [--pairs 3] [--threads 1]
                                                      [--smoke]

A tiny-but-not-trivial Lumina 2 (width 256 = 4 heads x 64, 2 key/value heads, 2 + 2 refiner and 6 main blocks,
16-channel latents; 256x256 images = 256 image tokens; 64 Gemma tokens) is written to disk in the diffusers layout.
diffpipe trains it with `diffpipe train` (1 worker, the real cache, DeepSpeed PipelineEngine); its median step time
comes from metrics.jsonl (step_seconds) after warm-up. The plain loop runs the same forward
(Lumina2Transformer2DModel.forward as Lumina2Pipeline calls it, on the reversed time, with the caption mask),
backward, gradient clipping and AdamW step on the same transformer with the same peft LoRA (rank 16 on the plugin's
lora_targets). The two sides alternate for --pairs pairs (which goes first swaps every pair); the median of the
per-pair ratios is printed with its spread. Target: ratio <= 1.10. The shared skeleton is in
``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.testing import bench
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_lumina.plugin import plugin
from diffpipe_lumina.testing import TinyLumina2Config, write_tiny_lumina2

MODEL = TinyLumina2Config(hidden_size=256, num_layers=6, num_refiner_layers=2, num_attention_heads=4, num_kv_heads=2,
                          axes_dim_rope=(16, 24, 24), latent_channels=16, text_dim=64, gemma_layers=2)
TEXT_LEN, SIZE = 64, 256
CAPTION = "a photo of a red cat "
MODEL_TABLE = bench.model_table("lumina2", text_max_length=TEXT_LEN)


def diffpipe_times(root: Path, args) -> list[float]:
    """Train with `diffpipe train` in ``root`` (which holds ``model/``); step times from metrics.jsonl."""
    data = root / "images"
    write_image_dataset(data, 4, size=(SIZE, SIZE), captions=[f"{CAPTION}{i}" for i in range(4)])
    write_dataset_toml(root / "dataset.toml", data, resolutions=[SIZE], enable_ar_bucket=False)
    return bench.train_times(root, args, MODEL_TABLE)


def plain_times(model_dir: Path, args) -> list[float]:
    cfg, model = bench.plain_model(plugin, model_dir)
    latents = torch.randn(args.batch, MODEL.latent_channels, SIZE // 8, SIZE // 8)
    text = torch.randn(args.batch, TEXT_LEN, MODEL.text_dim)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir / "tokenizer"))
    tokens = tokenizer(f"{cfg.system_prompt} <Prompt Start> {CAPTION}0")
    mask = torch.zeros(args.batch, TEXT_LEN, dtype=torch.long)
    mask[:, : len(tokens.input_ids)] = 1  # as many real tokens as diffpipe's cached captions have

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = model(hidden_states=x_t, timestep=1 - t, encoder_hidden_states=text, encoder_attention_mask=mask)
        return -out.sample

    loss = bench.flow_loss(latents, forward, shift=cfg.shift)
    return bench.plain_step_times(model, plugin.lora_targets(model_config=cfg), loss, args.steps)


def main() -> None:
    args = bench.overhead_args(bench.bench_parser(threads=True))
    write = lambda model_dir: write_tiny_lumina2(model_dir, MODEL)  # noqa: E731
    pairs = bench.measure_overhead(args, write, diffpipe_times, plain_times, args.pairs)
    tokens = (SIZE // 16) ** 2
    print(f"model: Lumina 2 width 256, 2+2 refiner + 6 main blocks, {tokens} image + {TEXT_LEN} text tokens, batch "
          f"{args.batch}, LoRA r=16, float32, CPU threads {torch.get_num_threads()}; medians after {args.warmup} "
          "warm-up steps")
    if len(pairs) > 1:
        print(bench.ratio_report(pairs, "overhead ratio") + " (target <= 1.10)")


if __name__ == "__main__":
    main()
