"""Framework overhead on Cosmos: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA,
for each entry point.

    python diffpipe_cosmos/bench/step_time.py [--entry cosmos cosmos-predict2 cosmos-predict2.5] [--steps 20]
        [--rounds 3] [--smoke] [--conditioning text|video]

A tiny-but-not-trivial Cosmos transformer (inner dim 256 = 4 heads x 64, 4 blocks, 16-channel latents, 64 T5
tokens) is written to disk in the diffusers layout: ``cosmos-predict2`` trains on 256x256 images (32x32 latents,
256 tokens), ``cosmos`` on 9-frame 256x256 clips (2 x 32x32 latents, 512 tokens); ``cosmos-predict2.5`` on the
same images with 64 Qwen2.5-VL tokens (2 layers x 64: 128 features into its ``crossattn_proj``). diffpipe trains it with
`diffpipe train` (1 worker, the real cache, DeepSpeed PipelineEngine); the median step time comes from
metrics.jsonl (step_seconds) after warm-up. The plain loop runs the same objective (the core's EDM or flow-matching
maths), diffusers' ``CosmosTransformer3DModel.forward``, backward, gradient clipping and an AdamW step with the same
peft LoRA (rank 16 on the plugin's lora_targets). The two sides alternate in pairs (which goes first swaps every
pair); the median ratio and its spread are printed. Target: ratio <= 1.10. The shared skeleton is in
``diffpipe_core.testing.bench``. ``--conditioning video`` (``cosmos``, ``cosmos-predict2``): the video-to-world
transformer trained video-to-world (``[model] conditioning = "video"``) on 9-frame 128x128 clips conditioned on their
first latent frame; the plain loop gives the transformer the clean first frame, the condition mask (and Predict2's
per-frame timesteps) and masks the loss to the generated frames.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from diffpipe_core import edm
from diffpipe_core.diffusion import flow_matching_pair, masked_mse, sample_timesteps
from diffpipe_core.testing import bench
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset, write_video
from diffpipe_cosmos import resize
from diffpipe_cosmos.plugin import cosmos1, predict2
from diffpipe_cosmos.predict25 import predict25
from diffpipe_cosmos.testing import TinyCosmosConfig, write_tiny_cosmos
from diffpipe_cosmos.testing_predict25 import TinyPredict25Config, write_tiny_predict25

T5_LEN = 64
ENTRIES = {
    "cosmos": {"hooks": cosmos1, "variant": "1.0", "frames": 9, "pixels": 256},
    "cosmos-predict2": {"hooks": predict2, "variant": "predict2", "frames": 1, "pixels": 256},
    "cosmos-predict2.5": {"hooks": predict25, "variant": "predict2.5", "frames": 1, "pixels": 256},
}
TEXT_KEYS = {"cosmos-predict2.5": "text_max_length"}  # the others': t5_max_length


def model_config(variant: str, video2world: bool = False) -> TinyCosmosConfig:
    sizes = {"num_layers": 4, "num_attention_heads": 4, "attention_head_dim": 64, "latent_channels": 16, "text_dim": 64}
    return TinyCosmosConfig(variant=variant, video2world=video2world, **sizes)


def entry_sizes(entry: str, args: argparse.Namespace) -> dict:
    """The entry's frames and pixel size (video-to-world: 9-frame 128x128 clips)."""
    return {**ENTRIES[entry], "frames": 9, "pixels": 128} if args.conditioning == "video" else ENTRIES[entry]


def diffpipe_times(root: Path, entry: str, args: argparse.Namespace) -> list[float]:
    """Train with `diffpipe train` in ``root`` (which holds ``model/``); step times from metrics.jsonl."""
    e = entry_sizes(entry, args)
    size = e["pixels"]
    if e["frames"] == 1:
        write_image_dataset(root / "media", 8, size=(size, size))
    else:
        for i in range(8):
            fps = int(e["hooks"].default_fps)  # the model's rate (30 and 16 fps): every frame is a clip frame
            write_video(root / "media" / f"clip_{i}.mp4", e["frames"], fps=fps, size=(size, size), seed=i)
            (root / "media" / f"clip_{i}.txt").write_text(f"a robot arm {i}")
    write_dataset_toml(root / "dataset.toml", root / "media", resolutions=[size], frame_buckets=[e["frames"]])
    keys = {TEXT_KEYS.get(entry, "t5_max_length"): T5_LEN}
    if args.conditioning == "video":
        keys |= {"conditioning": "video", "conditioning_frames": 1}
    return bench.train_times(root, args, bench.model_table(entry, **keys))


def write_model(model_dir: Path, entry: str, video2world: bool = False) -> Path:
    if entry == "cosmos-predict2.5":
        sizes = vars(model_config("predict2")) | {"qwen_dim": 64}
        return write_tiny_predict25(model_dir, TinyPredict25Config(**sizes))
    return write_tiny_cosmos(model_dir, model_config(ENTRIES[entry]["variant"], video2world))


def plain_times(model_dir: Path, entry: str, args: argparse.Namespace) -> list[float]:
    e = entry_sizes(entry, args)
    hooks = e["hooks"]
    resize.install()
    cfg, model = bench.plain_model(hooks, model_dir)
    frames = 1 if e["frames"] == 1 else (e["frames"] - 1) // (8 if e["variant"] == "1.0" else 4) + 1
    latent = e["pixels"] // 8
    latents = torch.randn(args.batch, 16, frames, latent, latent)
    text = torch.randn(args.batch, T5_LEN, 128 if entry == "cosmos-predict2.5" else 64)
    extra = {}
    if entry == "cosmos-predict2.5":  # its text-to-world loop's all-zero condition mask
        extra["condition_mask"] = torch.zeros(args.batch, 1, frames, latent, latent)
    padding = torch.zeros(1, 1, e["pixels"], e["pixels"])
    fps = hooks.default_fps if frames > 1 else None

    video = args.conditioning == "video"
    cond = torch.zeros(args.batch, 1, frames, 1, 1)
    cond[:, :, :1] = 1.0
    cond_mask = cond.expand(args.batch, 1, frames, latent, latent)

    def loss(gen: torch.Generator) -> torch.Tensor:
        noise = torch.randn(latents.shape, generator=gen)
        if video and e["variant"] == "1.0":
            sigma = edm.sample_sigmas(args.batch, gen, 0.0, 1.0)
            x = edm.noisy(latents, noise, sigma)
            pre = edm.preconditioning(sigma, 0.5)
            aug = (latents + 0.001 * torch.randn(latents.shape, generator=gen)) / (0.001**2 + 0.25) ** 0.5
            x_in = cond * aug + (1 - cond) * pre.c_in.view(-1, 1, 1, 1, 1) * x
            out = model(x_in, pre.c_noise, text, fps=fps, condition_mask=cond_mask, padding_mask=padding).sample
            return edm.edm_loss(out, x, latents, sigma, 0.5, 1 - cond)
        if video:
            t = sample_timesteps(args.batch, gen)
            x_t, target = flow_matching_pair(latents, noise, t)
            x_in = cond * latents + (1 - cond) * x_t
            timestep = cond * 1e-4 + (1 - cond) * t.view(-1, 1, 1, 1, 1)
            out = model(x_in, timestep, text, fps=fps, condition_mask=cond_mask, padding_mask=padding).sample
            return masked_mse(out, target, 1 - cond)
        if e["variant"] == "1.0":
            sigma = edm.sample_sigmas(args.batch, gen, 0.0, 1.0)
            x = edm.noisy(latents, noise, sigma)
            pre = edm.preconditioning(sigma, 0.5)
            out = model(pre.c_in.view(-1, 1, 1, 1, 1) * x, pre.c_noise, text, fps=fps, padding_mask=padding).sample
            return edm.edm_loss(out, x, latents, sigma, 0.5)
        t = sample_timesteps(args.batch, gen)
        x_t, target = flow_matching_pair(latents, noise, t)
        out = model(x_t, t, text, padding_mask=padding, **extra).sample
        return masked_mse(out, target)

    return bench.plain_step_times(model, hooks.lora_targets(cfg), loss, args.steps)


def measure_entry(entry: str, args: argparse.Namespace) -> list[tuple[float, float]]:
    """The (diffpipe, plain) median step seconds of each pair for one entry point."""
    return bench.measure_overhead(
        args,
        lambda model_dir: write_model(model_dir, entry, args.conditioning == "video"),
        lambda root, args: diffpipe_times(root, entry, args),
        lambda model_dir, args: plain_times(model_dir, entry, args),
        args.rounds,
        label=f"{entry} round",
    )


def main() -> None:
    parser = bench.bench_parser(pairs="--rounds", threads=True)
    parser.add_argument("--entry", nargs="+", choices=sorted(ENTRIES), default=sorted(ENTRIES))
    parser.add_argument("--conditioning", choices=["text", "video"], default="text", help="video: video-to-world")
    args = bench.overhead_args(parser)
    if args.conditioning == "video" and "cosmos-predict2.5" in args.entry:
        parser.error("--conditioning video: cosmos and cosmos-predict2 only (give --entry cosmos cosmos-predict2)")
    for entry in args.entry:
        pairs = measure_entry(entry, args)
        ratios = [a / b for a, b in pairs]
        print(
            f"{entry} ({args.conditioning}): inner dim 256, 4 blocks, LoRA r=16, float32, batch {args.batch}, CPU "
            f"threads {torch.get_num_threads()}; medians of {args.steps - args.warmup} steps after {args.warmup} "
            "warm-up"
        )
        print(
            f"{entry} overhead ratio: {statistics.median(ratios):.3f} (median of {len(ratios)} rounds, spread "
            f"{min(ratios):.3f}-{max(ratios):.3f}; target <= 1.10)",
            flush=True,
        )


if __name__ == "__main__":
    main()
