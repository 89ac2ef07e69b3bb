"""What one sampling point costs against the denoising itself: the same number of plain forward passes.

    python bench/sample_point.py [--pairs 3] [--prompts 4] [--steps 10] [--cfg 2.0] [--dim 256] [--depth 6]
                                 [--size 256] [--threads 1] [--cpu-time] [--smoke]

In one process (a gloo group of 1), builds the reference model's pipeline engine with a LoRA (rank 16) as a run
does, then alternates, in pairs (``--pairs``, at least 3; which side goes first swaps every pair):

- diffpipe: one whole sampling point, ``PipelineSampler.sample`` as the trainer calls it: the denoising loop
  through the ``PipelineEngine`` with classifier-free guidance, the decoder (loaded once, at a warm-up point before
  the pairs) decoding every sample, PNG files, the contact sheet, ``prompts.json``, ``latents.safetensors`` and
  TensorBoard images;
- plain: ``--prompts x --steps`` forward passes of the same model (batch 2 under CFG, with the same LoRA), in plain
  PyTorch under ``no_grad``: the denoising alone.

Prints each pair and the median ratio with its spread. Target: ratio <= 1.10 (a sampling point costs no more than
its denoising, give or take the decoding and writing of the samples). The first (warm-up) point's time is printed
too: it includes loading the decoder, which later points reuse. ``--cpu-time`` measures this process's CPU seconds
instead of wall-clock ones (steadier on a shared machine; with one thread it is the compute both sides do).
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path

import torch

from diffpipe_core.testing import bench
from diffpipe_core.testing.media import write_dataset_toml
from diffpipe_reference.model import TinyDiT, TinyDiTConfig, write_tiny_model

TARGETS = ["to_q", "to_k", "to_v", "to_out", "fc1", "fc2"]
RUN = """
dataset = "dataset.toml"
seed = 1
[model]
type = "reference"
path = "model"
dtype = "float32"
[adapter]
rank = {rank}
[sample]
prompts = {prompts}
negative_prompt = "blurry"
steps = {steps}
cfg = {cfg}
"""


def _join_group() -> None:
    from diffpipe_core.quiet import library_prints, quiet_libraries

    quiet_libraries(cuda=torch.cuda.is_available())
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    quiet_libraries()
    with library_prints():
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    quiet_libraries()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3, help="alternating diffpipe / plain pairs (at least 3)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cfg", type=float, default=2.0)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (more than the free cores stalls it)")
    parser.add_argument("--cpu-time", action="store_true", help="CPU seconds of this process, not wall-clock ones")
    parser.add_argument("--smoke", action="store_true", help=bench.SMOKE_HELP)
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    _join_group()

    from torch.utils.tensorboard import SummaryWriter

    from diffpipe_core.adapters import apply_lora, lora_config
    from diffpipe_core.config import load_config
    from diffpipe_core.engine.stage_build import Layout, build_stage_module
    from diffpipe_core.registry import get_registry
    from diffpipe_core.sampling.loop import noise_generator
    from diffpipe_core.sampling.worker import prepare_sampling

    cfg_model = TinyDiTConfig(dim=args.dim, depth=args.depth, heads=4)
    batch = 2 if args.cfg > 1 else 1
    latent = args.size // cfg_model.vae_factor
    tokens = (latent // cfg_model.patch_size) ** 2
    print(f"model: TinyDiT dim={args.dim} depth={args.depth}, {tokens} image tokens, LoRA r=16, {args.prompts} "
          f"prompts x {args.steps} steps, cfg {args.cfg} (batch {batch}), {args.size} px, CPU threads {args.threads}, "
          f"{'CPU' if args.cpu_time else 'wall-clock'} time", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_tiny_model(root / "model", cfg_model)
        write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[args.size])  # no media: not read
        prompts = [f"prompt number {i}" for i in range(args.prompts)]
        (root / "run.toml").write_text(
            RUN.format(rank=bench.LORA_RANK, prompts=prompts, steps=args.steps, cfg=args.cfg).replace("'", '"')
        )
        registry = get_registry()
        cfg = load_config(root / "run.toml", registry, purpose="sample")
        plugin = registry.model("reference")
        device = torch.device("cpu")
        work = prepare_sampling(cfg, plugin, device)
        assert work is not None
        layout = Layout(0, 1, 1)
        built = build_stage_module(cfg, plugin, layout, device)  # as training builds it: LoRA trainable
        import deepspeed

        from diffpipe_core.quiet import library_prints

        trainable = [p for p in built.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        with library_prints():
            engine, _, _, _ = deepspeed.initialize(
                model=built.module,
                optimizer=optimizer,
                config={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                        "steps_per_print": 1 << 30},
            )  # fmt: skip
        sampler = work.sampler(plugin, cfg, engine, layout, device)
        writer = SummaryWriter(str(root / "tb"))
        points = iter(range(1, 1 << 20))

        def one_point() -> float:
            t0 = clock()
            step = next(points)
            sampler.sample(root / "samples" / f"step-{step:07d}", step, writer)
            return clock() - t0

        torch.manual_seed(0)
        plain_model = TinyDiT(cfg_model)  # random weights: only the time counts
        apply_lora(plain_model, lora_config(bench.LORA_RANK, bench.LORA_RANK, 0.0, TARGETS))
        plain_model.eval()
        x = torch.randn((batch, cfg_model.in_channels, latent, latent), generator=noise_generator(0, 0))
        text = torch.cat([work.texts[0].cond["text_embeds"]] * batch).float()

        def plain() -> float:
            t0 = clock()
            with torch.no_grad():
                for _ in range(args.prompts * args.steps):
                    plain_model(x, torch.full((batch,), 0.5), text)
            return clock() - t0

        print(f"warm-up point (loads the decoder): {one_point() * 1000:.1f} ms", flush=True)
        plain()
        pairs = bench.compare(
            one_point,
            plain,
            args.pairs,
            lambda i, ours, base: print(
                bench.pair_line(i, ours, base, plain_name=f"{args.prompts * args.steps} plain forwards"), flush=True
            ),
            args.smoke,
        )
        writer.close()
    if not args.smoke:
        print(bench.ratio_report(pairs, "sampling point / its forward passes (target <= 1.10)"))


if __name__ == "__main__":
    main()
