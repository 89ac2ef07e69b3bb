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

import torch

from diffpipe_core.parts.latents import pack_2x2
from diffpipe_core.testing import bench
from diffpipe_krea.plugin import plugin
from diffpipe_krea.testing import SELECT_LAYERS, TinyKrea2Config, write_tiny_krea2

MODEL = TinyKrea2Config(num_layers=4, num_attention_heads=4, num_key_value_heads=2, attention_head_dim=64,
                        axes_dims_rope=(16, 24, 24), latent_channels=16, text_dim=64)
TEXT_LEN, SIZE = 64, 256
WORDS = " ".join(["a long caption of a red cat on a house"] * 12)  # each caption fills the text length
diffpipe_times = bench.image_trainer(bench.model_table("krea2", text_max_length=TEXT_LEN), lambda i: f"{WORDS} {i}",
                                     SIZE)


def plain_inputs(model: torch.nn.Module, batch: int) -> bench.PlainInputs:
    """``Krea2Transformer2DModel.forward`` with the pipeline's position ids and text mask."""
    from diffusers import Krea2Pipeline

    h = w = SIZE // 8
    text = torch.randn(batch, TEXT_LEN, len(SELECT_LAYERS), MODEL.text_dim)
    mask = torch.ones(batch, TEXT_LEN, dtype=torch.bool)
    ids = Krea2Pipeline.prepare_position_ids(TEXT_LEN, h // 2, w // 2, torch.device("cpu"))

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(hidden_states=pack_2x2(x_t), encoder_hidden_states=text, timestep=t, position_ids=ids,
                     encoder_attention_mask=mask).sample

    return torch.randn(batch, MODEL.latent_channels, h, w), forward, pack_2x2


def main() -> None:
    bench.run_bench(lambda model_dir: write_tiny_krea2(model_dir, cfg=MODEL), diffpipe_times,
                    bench.plain_trainer(plugin, plain_inputs),
                    f"Krea 2 inner dim 256, 4 blocks, {bench.tokens_line(SIZE, TEXT_LEN)}")


if __name__ == "__main__":
    main()
