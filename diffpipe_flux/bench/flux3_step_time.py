"""Framework overhead on FLUX.3: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python diffpipe_flux/bench/flux3_step_time.py [--rounds 3] [--steps 20] [--warmup 4] [--batch 1] [--smoke]

A tiny-but-not-trivial FLUX.3 (inner dim 256 = 4 heads x 64, 2 mode blocks per mode + 4 joint blocks, 16-channel
latents; 256x256 images = 16 x 16 = 256 image tokens; one text window of 80 tokens of 8 tapped layers at width 64) is
written to disk in the diffusers layout. diffpipe trains it with `diffpipe train` (1 worker, the real cache,
DeepSpeed PipelineEngine); its median step time comes from metrics.jsonl after warm-up. The plain loop runs the same
forward (Flux3Transformer2DModel.forward with the pipeline's position ids), backward, gradient clipping and AdamW
step on the same transformer with the same peft LoRA (rank 16 on the plugin's lora_targets). The two sides alternate
for --rounds pairs (at least 3; which goes first swaps every pair); the median of the per-pair ratios is printed with
its spread. Target: ratio <= 1.10. The shared skeleton is in ``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

import torch

from diffpipe_core.testing import bench
from diffpipe_flux.flux2_latents import tokens
from diffpipe_flux.flux3 import flux3
from diffpipe_flux.flux3_layers import image_ids, text_ids
from diffpipe_flux.testing_flux3 import TinyFlux3Config, write_tiny_flux3

MODEL = TinyFlux3Config(num_layers=2, num_single_layers=4, num_attention_heads=4, attention_head_dim=64,
                        axes_dims_rope=(16, 16, 16, 16), latent_channels=16, text_dim=64)
TEXT_LEN, SIZE = 80, 256  # one text window (the pipeline pads each caption to a multiple of 80 tokens)
#: each caption's window is the 80 tokens
diffpipe_times = bench.image_trainer(bench.model_table("flux3", text_max_length=TEXT_LEN),
                                     lambda i: f"a photo of a red cat on a house {i}", SIZE)


def plain_inputs(model: torch.nn.Module, batch: int) -> bench.PlainInputs:
    """``Flux3Transformer2DModel.forward`` on the pipeline's position ids and one text window."""
    h = w = SIZE // 16
    text = torch.randn(batch, TEXT_LEN, 8 * MODEL.text_dim)
    img, txt = image_ids(h, w), text_ids(TEXT_LEN)

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(hidden_states=tokens(x_t), encoder_hidden_states=text, timestep=t, img_ids=img,
                     txt_ids=txt).sample

    return torch.randn(batch, 4 * MODEL.latent_channels, h, w), forward, tokens


def main() -> None:
    bench.run_bench(lambda model_dir: write_tiny_flux3(model_dir, cfg=MODEL), diffpipe_times,
                    bench.plain_trainer(flux3, plain_inputs),
                    f"FLUX.3 inner dim 256, 2 + 2 mode blocks, 4 joint blocks, {bench.tokens_line(SIZE, TEXT_LEN)}")


if __name__ == "__main__":
    main()
