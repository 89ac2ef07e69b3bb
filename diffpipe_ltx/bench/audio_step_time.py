"""The audio branch's share of an LTX-2 training step: diffpipe's step time with ``train_audio = true`` (both streams
trained, the clips' sound in the loss) / with ``train_audio = false`` (the video stream alone, the audio stream fed
noise), on the same clips with a sound track.

    python diffpipe_ltx/bench/audio_step_time.py [--steps 20] [--warmup 4] [--batch 1] [--pairs 3] [--threads 1]
        [--smoke]

The model is ``step_time.py``'s tiny-but-not-trivial LTX-2 (video inner dim 256, audio 128, 4 audio-video blocks;
25-frame clips at 256x384: 384 video tokens and 26 audio tokens; 64 text tokens), the clips carry a 440 Hz tone.
Both sides are ``diffpipe train`` runs (1 worker, the real cache, LoRA rank 16 on the plugin's default targets:
the video stream's, plus the audio stream's and the audio-video cross-attentions' with audio); each side's median
step time after warm-up comes from metrics.jsonl. The sides alternate for ``--pairs`` pairs (which goes first swaps
every pair); the median of the per-pair ratios (audio / video only) is printed with its spread.
The shared skeleton is in ``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

import argparse

import torch
from step_time import FRAMES, HEIGHT, LATENT, LTX2_MODEL, T5_LEN, WIDTH

from diffpipe_core.testing import bench
from diffpipe_ltx.ltx2_testing import write_clips, write_tiny_ltx2


def main() -> None:
    args = bench.overhead_args(bench.bench_parser(threads=True))
    pairs = bench.audio_share_pairs(args, lambda folder: write_tiny_ltx2(folder, LTX2_MODEL), write_clips, FRAMES,
                                    WIDTH, HEIGHT, "ltx-2", max_sequence_length=T5_LEN)
    report(args, pairs)


def report(args: argparse.Namespace, pairs: list[tuple[float, float]]) -> None:
    f, h, w = LATENT
    print(f"model: LTX-2 video inner dim 256 (audio 128), 4 blocks, {f}x{h}x{w} = {f * h * w} video + 26 audio + "
          f"{T5_LEN} text tokens, batch {args.batch}, LoRA r=16, float32, CPU threads {torch.get_num_threads()}; "
          f"medians of {args.steps - args.warmup} steps after {args.warmup} warm-up")
    ratios = [a / b for a, b in pairs]
    print(f"step time with audio / video only: {sorted(ratios)[len(ratios) // 2]:.3f} (median of {len(ratios)} "
          f"pairs, spread {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
