"""Framework overhead on Flux: diffpipe's step time / a plain PyTorch loop's, same transformer, batch and LoRA.

    python diffpipe_flux/bench/step_time.py [--steps 30] [--warmup 5] [--batch 1]

A tiny-but-not-trivial Flux (inner dim 256 = 4 heads x 64, 2 double + 4 single blocks, 16-channel latents
of 64x64 = 1024 packed image tokens, 64 T5 tokens) is written to disk in the diffusers layout. diffpipe
trains it with `diffpipe train` (1 worker, the real cache, DeepSpeed PipelineEngine); the median step time
comes from metrics.jsonl (step_seconds) after warm-up. The plain loop runs the same
forward (FluxTransformer2DModel.forward), backward, gradient clipping and AdamW step on the same
transformer with the same peft LoRA (rank 16 on the plugin's lora_targets). Target: ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from diffpipe_core.adapters import apply_lora, lora_config
from diffpipe_core.diffusion import flow_matching_pair, masked_mse, sample_timesteps
from diffpipe_core.engine.run_dir import step_seconds
from diffpipe_core.schema import validate
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_core.testing.processes import cli_env, run_diffpipe
from diffpipe_flux import plugin
from diffpipe_flux.config import FluxConfig
from diffpipe_flux.packing import image_ids, pack, text_ids
from diffpipe_flux.testing import TinyFluxConfig, write_tiny_flux

MODEL = TinyFluxConfig(
    num_layers=2,
    num_single_layers=4,
    num_attention_heads=4,
    attention_head_dim=64,
    axes_dims_rope=(16, 24, 24),
    latent_channels=16,
    text_dim=64,
    clip_dim=64,
)
T5_LEN, LATENT = 64, 64  # 64x64 latents = 512x512 pixels


def diffpipe_step_times(root: Path, args: argparse.Namespace) -> list[float]:
    """Train with `diffpipe train` in ``root`` (which holds ``model/``); step times from metrics.jsonl."""
    write_image_dataset(root / "images", 8, size=(LATENT * 8, LATENT * 8))
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[LATENT * 8])
    (root / "run.toml").write_text(
        f"""
output_dir = "out"
dataset = "dataset.toml"
max_steps = {args.steps}
micro_batch_size_per_gpu = {args.batch}
gradient_accumulation_steps = 1
seed = 1
[model]
type = "flux"
path = "model"
dtype = "float32"
encoder_dtype = "float32"
t5_max_length = {T5_LEN}
[adapter]
rank = 16
[optimizer]
lr = 1e-4
"""
    )
    env = cli_env(HF_HOME=str(root / "hf_home"))
    result = run_diffpipe(["train", "--config", "run.toml", "--num-procs", "1"], cwd=root, timeout=1800, env=env)
    if result.returncode != 0:
        sys.exit(result.output[-3000:])
    run = next((root / "out").iterdir())
    return step_seconds(run)


def plain_step_times(model_dir: Path, args: argparse.Namespace) -> list[float]:
    cfg = validate(FluxConfig, {"type": "flux", "path": model_dir, "dtype": "float32"}, "bench")
    torch.manual_seed(0)
    model = plugin.load_diffusion_model(cfg, torch.device("cpu"), torch.float32)
    apply_lora(model, lora_config(16, 16, 0.0, plugin.lora_targets(cfg)))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01)
    latents = torch.randn(args.batch, MODEL.latent_channels, LATENT, LATENT)
    text, pooled = torch.randn(args.batch, T5_LEN, MODEL.text_dim), torch.randn(args.batch, MODEL.clip_dim)
    img, txt = image_ids(LATENT, LATENT).float(), text_ids(T5_LEN).float()
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        noise = torch.randn(latents.shape, generator=gen)
        t = sample_timesteps(args.batch, gen)
        x_t, target = flow_matching_pair(latents, noise, t)
        out = model(
            hidden_states=pack(x_t),
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=t,
            img_ids=img,
            txt_ids=txt,
            guidance=torch.ones(args.batch),
        ).sample
        loss = masked_mse(out, pack(target))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="alternate plain / diffpipe this many times")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_tiny_flux(model_dir, MODEL)
        # On a shared machine the load drifts: alternate the two measurements and compare each pair.
        for r in range(args.rounds):
            plain = statistics.median(plain_step_times(model_dir, args)[args.warmup :])
            root = Path(tmp) / f"run{r}"
            root.mkdir()
            (root / "model").symlink_to(model_dir)
            ours = statistics.median(diffpipe_step_times(root, args)[args.warmup :])
            ratios.append(ours / plain)
            print(
                f"round {r + 1}: diffpipe {ours * 1000:.1f} ms, plain PyTorch {plain * 1000:.1f} ms, "
                f"ratio {ours / plain:.3f}",
                flush=True,
            )
    print(
        f"model: Flux inner dim 256, 2 double + 4 single blocks, {(LATENT // 2) ** 2} image + {T5_LEN} text tokens, "
        f"batch {args.batch}, LoRA r=16, float32, CPU threads {torch.get_num_threads()}; medians of "
        f"{args.steps - args.warmup} steps after {args.warmup} warm-up"
    )
    print(f"overhead ratio: {statistics.median(ratios):.3f} (median of {len(ratios)} rounds; target <= 1.10)")


if __name__ == "__main__":
    main()
