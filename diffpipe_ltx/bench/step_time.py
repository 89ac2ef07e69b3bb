"""Framework overhead on LTX-Video and LTX-2: diffpipe's step time / a plain PyTorch loop's, same transformer, batch
and LoRA.

    python diffpipe_ltx/bench/step_time.py [--model ltx-video|ltx-2] [--steps 20] [--warmup 4] [--batch 1]
        [--rounds 3] [--smoke]

A tiny-but-not-trivial LTX-Video (inner dim 256 = 4 heads x 64, 4 blocks, 8-channel latents; 25-frame clips at
256x384 = 4 x 8 x 12 = 384 video tokens; 64 T5 tokens) is written to disk in the diffusers layout. diffpipe trains
it with `diffpipe train` (1 worker, the real cache, DeepSpeed PipelineEngine); its median step time comes from
metrics.jsonl (step_seconds) after warm-up. The plain loop runs the same forward (LTXVideoTransformer3DModel.forward
with LTXPipeline's video coordinates), backward, gradient clipping and AdamW step on the same transformer with the
same peft LoRA (rank 16 on the plugin's lora_targets). The two sides alternate for --rounds pairs (at least 3;
which goes first swaps every pair); the median of the per-pair ratios is printed with its spread, and the same for
each side's fastest step (the step least disturbed on a shared machine). Target: ratio <= 1.10.
With ``--model ltx-2`` the model is a tiny-but-not-trivial LTX-2 (video inner dim 256 = 4 heads x 64, audio 128,
4 audio-video blocks, 8-channel latents; the same clips: 384 video tokens and 26 audio tokens; 64 text tokens) and the
plain loop calls ``LTX2VideoTransformer3DModel.forward`` as ``LTX2Pipeline`` does, with the audio stream given noise
(what the plugin trains with) and the loss on the video prediction.
The shared skeleton is in ``diffpipe_core.testing.bench``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from diffpipe_core.testing import bench
from diffpipe_ltx.geometry import rope_interpolation_scale
from diffpipe_ltx.ltx2 import ltx2
from diffpipe_ltx.ltx2_testing import TinyLTX2Config, write_tiny_ltx2
from diffpipe_ltx.ltx2_testing import write_clips as write_ltx2_clips
from diffpipe_ltx.packing import pack
from diffpipe_ltx.plugin import plugin
from diffpipe_ltx.testing import TinyLTXConfig, write_clips, write_tiny_ltx

MODEL = TinyLTXConfig(num_layers=4, num_attention_heads=4, attention_head_dim=64, latent_channels=8, text_dim=64)
T5_LEN, FRAMES, WIDTH, HEIGHT = 64, 25, 384, 256
LATENT = (FRAMES - 1) // 8 + 1, HEIGHT // 32, WIDTH // 32
MODEL_TABLE = bench.model_table("ltx-video", t5_max_length=T5_LEN)


def diffpipe_times(root: Path, args: argparse.Namespace) -> list[float]:
    """Train with `diffpipe train` in ``root`` (which holds ``model/``); step times from metrics.jsonl."""
    bench.clip_dataset(root, write_clips, FRAMES, WIDTH, HEIGHT)
    return bench.train_times(root, args, MODEL_TABLE)


def plain_times(model_dir: Path, args: argparse.Namespace) -> list[float]:
    cfg, model = bench.plain_model(plugin, model_dir)
    f, h, w = LATENT
    latents = torch.randn(args.batch, MODEL.latent_channels, f, h, w)
    text = torch.randn(args.batch, T5_LEN, MODEL.text_dim)
    mask = torch.ones(args.batch, T5_LEN)
    mask[:, T5_LEN // 4 :] = 0
    scale = rope_interpolation_scale(cfg)

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(
            hidden_states=pack(x_t),
            encoder_hidden_states=text,
            timestep=t * 1000,
            encoder_attention_mask=mask,
            num_frames=f,
            height=h,
            width=w,
            rope_interpolation_scale=scale,
        ).sample

    loss = bench.flow_loss(latents, forward, pack)
    return bench.plain_step_times(model, plugin.lora_targets(model_config=cfg), loss, args.steps)


LTX2_MODEL = TinyLTX2Config(num_layers=4, num_attention_heads=4, attention_head_dim=64, latent_channels=8, text_dim=64)
LTX2_TABLE = bench.model_table("ltx-2", max_sequence_length=T5_LEN)


def ltx2_plain_times(model_dir: Path, args: argparse.Namespace) -> list[float]:
    cfg, model = bench.plain_model(ltx2, model_dir, max_sequence_length=T5_LEN)
    f, h, w = LATENT
    latents = torch.randn(args.batch, LTX2_MODEL.latent_channels, f, h, w)
    text, audio_text = (torch.randn(args.batch, T5_LEN, LTX2_MODEL.text_dim) for _ in range(2))
    mask = torch.ones(args.batch, T5_LEN)
    audio_shape = ltx2.geometry(cfg).audio_shape(args.batch, f)

    def forward(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        audio = torch.randn(audio_shape).transpose(1, 2).flatten(2, 3)
        video, _ = model(
            hidden_states=pack(x_t), audio_hidden_states=audio, encoder_hidden_states=text,
            audio_encoder_hidden_states=audio_text, timestep=t * 1000, sigma=t * 1000, encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask, num_frames=f, height=h, width=w, fps=24.0,
            audio_num_frames=audio.shape[1], use_cross_timestep=True, return_dict=False,
        )
        return video

    loss = bench.flow_loss(latents, forward, pack)
    return bench.plain_step_times(model, ltx2.lora_targets(model_config=cfg), loss, args.steps)


def main() -> None:
    parser = bench.bench_parser(pairs="--rounds", threads=True)
    parser.add_argument("--model", choices=("ltx-video", "ltx-2"), default="ltx-video")
    args = bench.overhead_args(parser)
    if args.model == "ltx-2":
        ltx2_main(args)
        return
    # Each side's fastest step is printed too: it is the one least disturbed by other processes.
    fastest: dict[str, list[float]] = {"ours": [], "plain": []}

    def noted(side: str, times: list[float]) -> list[float]:
        fastest[side].append(min(times[args.warmup :], default=float("nan")))
        return times

    def show(r: int, a: float, b: float) -> None:
        best_ours, best_plain = fastest["ours"][r], fastest["plain"][r]
        print(
            f"{bench.pair_line(r, a, b, label='round')} (fastest steps: {best_ours * 1000:.1f} / "
            f"{best_plain * 1000:.1f} ms = {best_ours / best_plain:.3f})",
            flush=True,
        )

    pairs = bench.measure_overhead(
        args,
        lambda model_dir: write_tiny_ltx(model_dir, MODEL),
        lambda root, args: noted("ours", diffpipe_times(root, args)),
        lambda model_dir, args: noted("plain", plain_times(model_dir, args)),
        args.rounds,
        show,
    )
    best_ratios = [a / b for a, b in zip(fastest["ours"], fastest["plain"], strict=True)]
    f, h, w = LATENT
    print(
        f"model: LTX-Video inner dim 256, 4 blocks, {f}x{h}x{w} = {f * h * w}"
        f" video + {T5_LEN} text tokens, batch {args.batch}, LoRA r=16, float32, CPU threads {torch.get_num_threads()};"
        f" medians of {args.steps - args.warmup} steps after {args.warmup} warm-up"
    )
    print(
        f"{bench.ratio_line(pairs)}; fastest-step ratio "
        f"{statistics.median(best_ratios):.3f} (spread {min(best_ratios):.3f}-{max(best_ratios):.3f})"
    )


def ltx2_main(args: argparse.Namespace) -> None:
    pairs = bench.measure_overhead(
        args,
        lambda model_dir: write_tiny_ltx2(model_dir, LTX2_MODEL),
        lambda root, args: (bench.clip_dataset(root, write_ltx2_clips, FRAMES, WIDTH, HEIGHT),
                            bench.train_times(root, args, LTX2_TABLE))[1],
        ltx2_plain_times,
        args.rounds,
        lambda r, a, b: print(bench.pair_line(r, a, b, label="round"), flush=True),
    )
    f, h, w = LATENT
    print(f"model: LTX-2 video inner dim 256 (audio 128), 4 blocks, {f}x{h}x{w} = {f * h * w} video + 26 audio + "
          f"{T5_LEN} text tokens, batch {args.batch}, LoRA r=16, float32, CPU threads {torch.get_num_threads()}")
    print(bench.ratio_line(pairs))


if __name__ == "__main__":
    main()
