"""The audio branch's share of a MiniMax H3 training step: diffpipe's step time with ``train_audio = true`` (the clips'
sound packed beside the video rows and in the loss) / with ``train_audio = false`` (no audio rows, as a silent clip
trains), on the same clips with a sound track.

    python plugins/diffpipe_minimax/bench/audio_step_time.py [--steps 20] [--warmup 4] [--batch 1] [--pairs 3]
        [--threads 1] [--smoke]

The model is ``step_time.py``'s (width 256, 4 blocks; 22-frame clips at 256x256: 448 video rows; the tiny audio VAE's
latents of the clips' 440 Hz tone at 24 fps beside them), both sides ``diffpipe train`` runs (1 worker, the real cache,
LoRA rank 16 on the plugin's targets, the same with and without sound: one stream of blocks). The sides alternate for
``--pairs`` pairs (which goes first swaps every pair); the median of the per-pair ratios (with / without audio) is
printed with its spread. The shared skeleton is ``diffpipe_core.testing.bench.audio_share_pairs``.
"""

from __future__ import annotations

import torch
from step_time import FRAMES, LATENT, MODEL, SIZE, TEXT_LEN

from diffpipe_core.testing import bench
from diffpipe_core.testing.media import write_clip_dataset
from diffpipe_minimax.testing import write_tiny_minimax


def write_clips(folder, captions: list[str], frames: int, size: tuple[int, int], audio: str) -> None:
    write_clip_dataset(folder, frames, captions, size=size, fps=24, audio=audio)


def main() -> None:
    args = bench.overhead_args(bench.bench_parser(threads=True))
    pairs = bench.audio_share_pairs(args, lambda folder: write_tiny_minimax(folder, MODEL), write_clips, FRAMES, SIZE,
                                    SIZE, "minimax-h3", text_max_length=TEXT_LEN)
    f, h, w = LATENT
    print(f"model: MiniMax H3 width 256, 4 blocks, {f}x{h // 2}x{w // 2} = {f * h * w // 4} video rows + the clips' "
          f"audio rows + the caption's, batch {args.batch}, LoRA r=16, float32, CPU threads {torch.get_num_threads()}; "
          f"medians of {args.steps - args.warmup} steps after {args.warmup} warm-up")
    if len(pairs) > 1:
        print(bench.ratio_report(pairs, "step time with audio / without"))


if __name__ == "__main__":
    main()
