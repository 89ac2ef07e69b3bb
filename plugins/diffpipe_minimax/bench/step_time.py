"""Framework overhead on MiniMax H3: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python plugins/diffpipe_minimax/bench/step_time.py [--steps 20] [--warmup 4] [--batch 1] [--pairs 3] [--smoke]

A tiny-but-not-trivial MiniMax H3 (width 256 = 4 heads x 64, 4 blocks, SwiGLU 512, 16 video latent channels; 22-frame
clips at 256x256 = 7 x 16 x 16 latents = 7 x 8 x 8 = 448 video rows after the 2x2 patches; the caption's text rows ("a
clip i") of width 128) is written to disk as a modular pipeline folder. diffpipe trains it with `diffpipe train` (1
worker, the real cache, DeepSpeed PipelineEngine; no sound: `train_audio` off, so no audio rows, as a silent clip
trains); its median step time comes from metrics.jsonl (step_seconds) after warm-up. The plain loop runs the same
forward (MiniMaxH3Transformer3DModel.forward on the pipeline's packed layout at t = 1 - sigma), the flow-matching loss
toward the data-ward velocity, backward, gradient clipping and AdamW step on the same transformer with the same peft
LoRA (rank 16 on the plugin's lora_targets). The two sides alternate for --pairs pairs (which goes first swaps every
pair); the median of the per-pair ratios is printed with its spread. Target: ratio <= 1.10. The shared skeleton is in
``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from diffpipe_core.testing import bench
from diffpipe_core.testing.media import write_clip_dataset
from diffpipe_minimax.packing import layout, patchify
from diffpipe_minimax.plugin import plugin
from diffpipe_minimax.testing import TinyMiniMaxConfig, write_tiny_minimax

MODEL = TinyMiniMaxConfig(num_layers=4, hidden=256, heads=4, head_dim=64, video_channels=16, text_dim=128)
TEXT_LEN, FRAMES, SIZE = 64, 22, 256
LATENT = 7, SIZE // 16, SIZE // 16
MODEL_TABLE = bench.model_table("minimax-h3", text_max_length=TEXT_LEN)


def write_clips(folder: Path, captions: list[str], frames: int, size: tuple[int, int]) -> None:
    write_clip_dataset(folder, frames, captions, size=size, fps=24)


diffpipe_times = bench.clip_trainer(write_clips, FRAMES, SIZE, SIZE, MODEL_TABLE)


def plain_times(model_dir: Path, args: argparse.Namespace) -> list[float]:
    from transformers import AutoTokenizer

    cfg, model = bench.plain_model(plugin, model_dir)
    tokens = len(AutoTokenizer.from_pretrained(str(model_dir / "tokenizer"))("a clip 0").input_ids)  # diffpipe's
    latents = torch.randn(args.batch, MODEL.video_channels, *LATENT)
    text = torch.randn(args.batch, tokens, MODEL.text_dim)
    lay = layout(tokens, LATENT, 0, (1, 2, 2))
    audio = torch.zeros(args.batch, 0, MODEL.audio_channels)

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = model(hidden_states=patchify(x_t, (1, 2, 2)), audio_hidden_states=audio, encoder_hidden_states=text,
                    timestep=torch.stack([1 - t[0], 1 - t[0]]), timestep_indices=lay.timestep_indices,
                    token_tags=lay.token_tags, position_ids=lay.position_ids, video_indices=lay.video_indices,
                    audio_indices=lay.audio_indices, text_indices=torch.arange(tokens), return_dict=False)
        return out[0].float()

    loss = bench.flow_loss(latents, forward, lambda target: -patchify(target, (1, 2, 2)))
    return bench.plain_step_times(model, plugin.lora_targets(model_config=cfg), loss, args.steps)


def main() -> None:
    args = bench.overhead_args(bench.bench_parser(threads=True))
    write = lambda model_dir: write_tiny_minimax(model_dir, MODEL)  # noqa: E731
    pairs = bench.measure_overhead(args, write, diffpipe_times, plain_times, args.pairs)
    f, h, w = LATENT
    tokens = f"{f}x{h // 2}x{w // 2} = {f * h * w // 4} video rows + the caption's text rows"
    print(bench.setup_line(f"MiniMax H3 width 256, 4 blocks, {tokens}", args))
    if len(pairs) > 1:
        print(bench.ratio_line(pairs))


if __name__ == "__main__":
    main()
