"""Framework overhead on Qwen-Image: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python plugins/diffpipe_qwenimage/bench/step_time.py [--steps 20] [--warmup 4] [--batch 1] [--rounds 3] [--smoke]

A tiny-but-not-trivial Qwen-Image (inner dim 256 = 4 heads x 64, 4 blocks, 16-channel latents; 256x256 images =
16 x 16 = 256 image tokens; 64 text tokens) is written to disk in the diffusers layout. diffpipe trains it with
`diffpipe train` (1 worker, the real cache, DeepSpeed PipelineEngine); its median step time comes from metrics.jsonl
(step_seconds) after warm-up. The plain loop runs the same forward (QwenImageTransformer2DModel.forward with the
pipeline's img_shapes and text mask), backward, gradient clipping and AdamW step on the same transformer with the same
peft LoRA (rank 16 on the plugin's lora_targets). The two sides alternate for --rounds pairs (at least 3; which goes
first swaps every pair); the median of the per-pair ratios is printed with its spread. Target: ratio <= 1.10.
The shared skeleton is in ``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

import torch

from diffpipe_core.parts.latents import pack_2x2
from diffpipe_core.testing import bench
from diffpipe_qwenimage.plugin import plugin
from diffpipe_qwenimage.testing import TinyQwenConfig, write_tiny_qwen

MODEL = TinyQwenConfig(num_layers=4, num_attention_heads=4, attention_head_dim=64, axes_dims_rope=(16, 24, 24),
                       latent_channels=16, text_dim=64)
TEXT_LEN, SIZE = 64, 256


def caption(i: int) -> str:
    """The 4 long captions (Qwen-Image's and Qwen-Image 2.1's benches)."""
    return " ".join(["a long caption of a red cat on a house"] * 6) + f" {i}"


diffpipe_times = bench.image_trainer(bench.model_table("qwen-image", text_max_length=TEXT_LEN), caption, SIZE)


def plain_inputs(model: torch.nn.Module, batch: int) -> bench.PlainInputs:
    """``QwenImageTransformer2DModel.forward`` with the pipeline's img_shapes and text mask."""
    h = w = SIZE // 8
    text = torch.randn(batch, TEXT_LEN, MODEL.text_dim)
    mask = torch.ones(batch, TEXT_LEN, dtype=torch.bool)
    shapes = [[(1, h // 2, w // 2)]] * batch

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(hidden_states=pack_2x2(x_t), encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                     timestep=t, img_shapes=shapes).sample

    return torch.randn(batch, MODEL.latent_channels, h, w), forward, pack_2x2


def main() -> None:
    bench.run_bench(lambda model_dir: write_tiny_qwen(model_dir, cfg=MODEL), diffpipe_times,
                    bench.plain_trainer(plugin, plain_inputs),
                    f"Qwen-Image inner dim 256, 4 blocks, {bench.tokens_line(SIZE, TEXT_LEN)}")


if __name__ == "__main__":
    main()
