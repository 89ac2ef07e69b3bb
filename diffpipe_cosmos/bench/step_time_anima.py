"""Framework overhead on Anima: diffpipe's step time / a plain PyTorch loop's, same model, batch and LoRA.

    python diffpipe_cosmos/bench/step_time_anima.py [--steps 20] [--warmup 4] [--batch 1] [--rounds 3] [--smoke]

A tiny-but-not-trivial Anima (Predict2's transformer at inner dim 256 = 4 heads x 64, 4 blocks, 16-channel latents;
a 2-block LLM adapter of width 64 padding to 64 text tokens; 256x256 images = 256 tokens) is written to disk as an
``AnimaModularPipeline`` folder. diffpipe trains it with `diffpipe train` (1 worker, the real cache, DeepSpeed
PipelineEngine; the adapter frozen, as by default); its median step time comes from metrics.jsonl after warm-up. The
plain loop runs the same adapter (frozen) and ``CosmosTransformer3DModel.forward``, the rectified-flow loss, backward,
gradient clipping and an AdamW step with the same peft LoRA (rank 16 on the plugin's lora_targets). The two sides
alternate for --rounds pairs (at least 3; which goes first swaps every pair); the median of the per-pair ratios is
printed with its spread. Target: ratio <= 1.10. The shared skeleton is in ``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

import torch

from diffpipe_core.testing import bench
from diffpipe_cosmos import resize
from diffpipe_cosmos.anima import anima as plugin
from diffpipe_cosmos.testing_anima import TinyAnimaConfig, write_tiny_anima

MODEL = TinyAnimaConfig(num_layers=4, num_attention_heads=4, attention_head_dim=64, latent_channels=16, text_dim=64,
                        min_sequence_length=64)
TEXT_LEN, SIZE = 64, 256
diffpipe_times = bench.image_trainer(bench.model_table("anima", text_max_length=TEXT_LEN),
                                     lambda i: " ".join(["a photo of a red cat on a house"] * 10) + f" {i}", SIZE)


def plain_inputs(model: torch.nn.Module, batch: int) -> bench.PlainInputs:
    """The LLM adapter (frozen, as ``llm_adapter_lr = 0`` leaves it), then ``CosmosTransformer3DModel.forward``."""
    resize.install()
    model.text_conditioner.requires_grad_(False)
    qwen, ids = torch.randn(batch, TEXT_LEN, MODEL.text_dim), torch.randint(0, 40, (batch, TEXT_LEN))
    mask = torch.ones(batch, TEXT_LEN, dtype=torch.long)
    padding = torch.zeros(1, 1, SIZE, SIZE)

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        text = model.text_conditioner(qwen, ids, mask, mask)
        return model(hidden_states=x_t, timestep=t, encoder_hidden_states=text, padding_mask=padding).sample

    return torch.randn(batch, MODEL.latent_channels, 1, SIZE // 8, SIZE // 8), forward, None


def main() -> None:
    bench.run_bench(lambda model_dir: write_tiny_anima(model_dir, MODEL), diffpipe_times,
                    bench.plain_trainer(plugin, plain_inputs),
                    f"Anima inner dim 256, 4 blocks, {bench.tokens_line(SIZE, TEXT_LEN)}")


if __name__ == "__main__":
    main()
