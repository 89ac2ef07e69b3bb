"""Framework overhead on Qwen-Image 2.1: diffpipe's step time / a plain PyTorch loop's, same transformer, batch, LoRA.

    python plugins/diffpipe_qwenimage/bench/step_time21.py [--steps 20] [--warmup 4] [--batch 1] [--rounds 3] [--smoke]

A tiny-but-not-trivial Qwen-Image 2.1 (inner dim 256 = 4 heads x 64, 4 single-stream blocks, 16-channel latents;
256x256 images = 16 x 16 = 256 image tokens; 64 text tokens) is written to disk in the diffusers layout. diffpipe trains
it with `diffpipe train` (1 worker, the real cache, DeepSpeed PipelineEngine); its median step time comes from
metrics.jsonl after warm-up. The plain loop runs the same forward (QwenImage21Transformer2DModel.forward with the
pipeline's img_shapes, image slots and no text padding), backward, gradient clipping and AdamW step on the same
transformer with the same peft LoRA (rank 16 on the plugin's lora_targets). The two sides alternate for --rounds pairs
(at least 3; which goes first swaps every pair); the median of the per-pair ratios is printed with its spread.
Target: ratio <= 1.10. The shared skeleton is in ``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

import step_time  # this folder's Qwen-Image bench (the script's folder is on sys.path)
import torch

from diffpipe_core.testing import bench
from diffpipe_qwenimage.qwen21 import flat, plugin
from diffpipe_qwenimage.testing21 import TinyQwen21Config, write_tiny_qwen21

MODEL = TinyQwen21Config(num_layers=4, num_attention_heads=4, attention_head_dim=64, axes_dims_rope=(16, 24, 24),
                         latent_channels=16, text_dim=64)
TEXT_LEN, SIZE = step_time.TEXT_LEN, step_time.SIZE
#: Qwen-Image's bench images and captions
diffpipe_times = bench.image_trainer(bench.model_table("qwen-image-2.1", text_max_length=TEXT_LEN), step_time.caption,
                                     SIZE)


def plain_inputs(model: torch.nn.Module, batch: int) -> bench.PlainInputs:
    """``QwenImage21Transformer2DModel.forward`` with the pipeline's img_shapes, image slots and no text padding."""
    h = w = SIZE // 16
    text = torch.randn(batch, TEXT_LEN, MODEL.text_dim)
    slots = torch.cat([torch.zeros(batch, TEXT_LEN, dtype=torch.bool),
                       torch.ones(batch, h * w // 4, dtype=torch.bool)], dim=1)
    shapes = [[(1, h, w)]] * batch

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(hidden_states=flat(x_t), encoder_hidden_states=text, timestep=t, img_shapes=shapes,
                     img_mask=slots).sample[:, -h * w :]

    return torch.randn(batch, MODEL.latent_channels, h, w), forward, flat


def main() -> None:
    bench.run_bench(lambda model_dir: write_tiny_qwen21(model_dir, cfg=MODEL), diffpipe_times,
                    bench.plain_trainer(plugin, plain_inputs),
                    f"Qwen-Image 2.1 inner dim 256, 4 blocks, {bench.tokens_line(SIZE, TEXT_LEN)}")


if __name__ == "__main__":
    main()
