"""Framework overhead on Ideogram 4: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python plugins/diffpipe_ideogram/bench/step_time.py [--steps 20] [--warmup 4] [--batch 1] [--rounds 3] [--smoke]

A tiny-but-not-trivial Ideogram 4 (inner dim 256 = 4 heads x 64, 4 blocks, 16-channel VAE latents = 64 token
channels; 256x256 images = 16 x 16 = 256 image tokens; 64 text tokens of 13 tapped layers at width 64) is written to
disk in the diffusers layout. diffpipe trains it with `diffpipe train` (1 worker, the real cache, DeepSpeed
PipelineEngine); its median step time comes from metrics.jsonl after warm-up. The plain loop runs the same forward
(Ideogram4Transformer2DModel.forward on the pipeline's packed sequence: its ids from `_prepare_ids`), backward,
gradient clipping and AdamW step on the same transformer with the same peft LoRA (rank 16 on the plugin's
lora_targets). The two sides alternate for --rounds pairs (at least 3; which goes first swaps every pair); the median
of the per-pair ratios is printed with its spread. Target: ratio <= 1.10. The shared skeleton is in
``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

import torch

from diffpipe_core.testing import bench
from diffpipe_ideogram.plugin import plugin, tokens
from diffpipe_ideogram.testing import TAPS, TinyIdeogram4Config, write_tiny_ideogram4

MODEL = TinyIdeogram4Config(num_layers=4, num_attention_heads=4, attention_head_dim=64, mrope_section=(6, 5, 5),
                            latent_channels=16, text_dim=64)
TEXT_LEN, SIZE = 64, 256
WORDS = " ".join(["a red cat on a house"] * 7)  # 63 tokens with the chat template: each caption fills the text length
diffpipe_times = bench.image_trainer(bench.model_table("ideogram4", text_max_length=TEXT_LEN),
                                     lambda i: f"{WORDS} {i}", SIZE)


def plain_inputs(model: torch.nn.Module, batch: int) -> bench.PlainInputs:
    """``Ideogram4Transformer2DModel.forward`` on the pipeline's packed sequence (its ids from ``_prepare_ids``)."""
    from diffusers import Ideogram4Pipeline

    h = w = SIZE // 16
    pos, seg, ind = Ideogram4Pipeline._prepare_ids([TEXT_LEN] * batch, h, w, TEXT_LEN, torch.device("cpu"))
    text = torch.randn(batch, TEXT_LEN + h * w, TAPS * MODEL.text_dim) * (ind == 3)[..., None]
    pad = torch.zeros(batch, TEXT_LEN, 4 * MODEL.latent_channels)

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = model(hidden_states=torch.cat([pad, tokens(x_t)], dim=1), timestep=1 - t, encoder_hidden_states=text,
                    position_ids=pos, segment_ids=seg, indicator=ind).sample
        return -out[:, TEXT_LEN:]

    return torch.randn(batch, 4 * MODEL.latent_channels, h, w), forward, tokens


def main() -> None:
    bench.run_bench(lambda model_dir: write_tiny_ideogram4(model_dir, cfg=MODEL), diffpipe_times,
                    bench.plain_trainer(plugin, plain_inputs),
                    f"Ideogram 4 inner dim 256, 4 blocks, {bench.tokens_line(SIZE, TEXT_LEN)}")


if __name__ == "__main__":
    main()
