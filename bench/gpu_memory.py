"""Peak GPU memory, step time and achieved TFLOP/s of a Flux-sized LoRA step, with and without the memory savers.

    python bench/gpu_memory.py [--steps 4] [--swap 40]        # one GPU, under 5 minutes on an H100/H200
    python bench/gpu_memory.py --small                         # a tiny Flux on CPU: checks the code path only

A diffusers ``FluxTransformer2DModel`` at Flux.1-dev's real dimensions (random bf16 weights, built on the GPU),
LoRA rank 16 on the usual targets, a 1024x1024 image (128x128 latents, 4096 image + 512 text tokens), run
through diffpipe's Flux pipeline layers and its memory wrappers (diffpipe_core.memory) in one process, so
the figures are those of the core's code without DeepSpeed's communication. Variants:

- plain: every weight resident, no checkpointing;
- checkpointing: ``activation_checkpointing = true``;
- swap + offload: ``blocks_to_swap = N`` and ``activation_checkpointing = "offload"``;
- nf4 / float8 bases (``[model] quantize``) with checkpointing, when diffpipe_core.quantize is present.

TFLOP/s counts 2 x parameters x tokens for the forward and twice that for the backward's input gradients
(frozen base weights get no weight gradient), which undercounts attention. Targets: swap + offload peak
<= 8 GB at <= 1.3x the checkpointing step time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch

from diffpipe_core.adapters import apply_lora, lora_config
from diffpipe_core.diffusion import flow_matching_pair
from diffpipe_core.engine.model_loading import cast_skeleton
from diffpipe_core.memory import wrap_stage_layers
from diffpipe_flux.layers import split_into_layers
from diffpipe_flux.packing import image_ids, pack, text_ids
from diffpipe_flux.plugin import ATTENTION_AND_MLP

FLUX_DEV = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)  # fmt: skip
SMALL = dict(
    patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6),
)  # fmt: skip
BLOCKS = ("DoubleBlockLayer", "SingleBlockLayer")


def build(config: dict[str, Any], device: torch.device, quantize: str | None) -> tuple[Any, list[Any], int]:
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    model = cast_skeleton(model.to_empty(device=device), torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.02)
    model.requires_grad_(False)
    n_params = sum(p.numel() for p in model.parameters())
    layers = split_into_layers(model)
    if quantize:  # what [model] quantize does to a loaded stage
        from diffpipe_core.engine.model_loading import StageModel
        from diffpipe_core.quantize import quantize_stage

        settings = SimpleNamespace(quantize=quantize, dtype="bfloat16")
        quantize_stage(settings, StageModel(model, layers, True), range(len(layers)), BLOCKS)  # type: ignore[arg-type]
    n_single = config["num_single_layers"]
    targets = ATTENTION_AND_MLP + [f"single_transformer_blocks.{i}.proj_out" for i in range(n_single)]
    apply_lora(model, lora_config(16, 16, 0.0, targets))
    return model, layers, n_params


def inputs(config: dict[str, Any], size: int, text_len: int, device: torch.device) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(0)
    h = w = size // 8
    latents = torch.randn(1, config["in_channels"] // 4, h, w, generator=g)
    x_t, target = flow_matching_pair(latents, torch.randn(latents.shape, generator=g), torch.tensor([0.5]))
    text = torch.randn(1, text_len, config["joint_attention_dim"], generator=g)
    pooled = torch.randn(1, config["pooled_projection_dim"], generator=g)
    batch = (pack(x_t), torch.tensor([0.5]), text, pooled, torch.tensor([1.0]), image_ids(h, w), text_ids(text_len))
    return tuple(t.to(device) for t in batch), pack(target).to(device)


def run_variant(name: str, args: argparse.Namespace, device: torch.device, checkpointing: Any, swap: int,
                quantize: str | None = None) -> dict[str, float]:  # fmt: skip
    config = SMALL if args.small else FLUX_DEV
    model, layers, n_params = build(config, device, quantize)
    layers, swapped = wrap_stage_layers(layers, range(len(layers)), BLOCKS, checkpointing, swap, device)
    for layer in layers:
        layer.to(device)  # what PipelineModule does; swapped blocks' weights stay in host memory
    lora = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora, lr=1e-4)
    x, target = inputs(config, args.size, args.text_len, device)
    tokens = (args.size // 16) ** 2 + args.text_len
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps + 1):
        start = time.perf_counter()
        out = x
        for layer in layers:
            out = layer(out)
        loss = torch.nn.functional.mse_loss(out[0].float(), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step:  # the first step warms up kernels and allocator
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else float("nan")
    tflops = 6 * n_params * tokens / seconds / 1e12
    print(f"{name:<22} swapped {swapped:>3} blocks  peak {peak:6.2f} GB  step {seconds:7.3f} s  {tflops:6.1f} TFLOP/s",
          flush=True)  # fmt: skip
    del model, layers, optimizer, out, loss
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"peak": peak, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--swap", type=int, default=40, help="blocks_to_swap (of 57 Flux blocks)")
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels")
    parser.add_argument("--text-len", type=int, default=512)
    parser.add_argument("--small", action="store_true", help="tiny Flux on the CPU: a check of the code path")
    args = parser.parse_args()
    if args.small:
        args.size, args.text_len, args.swap, args.steps = 64, 16, 3, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    print(f"device {device}; Flux {'(small)' if args.small else 'dev dimensions'}; {args.size}^2 image", flush=True)
    plain = run_variant("plain", args, device, False, 0)
    ckpt = run_variant("checkpointing", args, device, True, 0)
    swapped = run_variant("swap + offload", args, device, "offload", args.swap)
    for quantize in ("nf4", "float8"):
        try:
            run_variant(f"{quantize} + checkpointing", args, device, True, 0, quantize)
        except ImportError as exc:
            print(f"{quantize}: skipped ({exc})")
    print(
        f"swap + offload: peak {swapped['peak']:.2f} GB (target <= 8), step time "
        f"{swapped['seconds'] / ckpt['seconds']:.2f}x checkpointing (target <= 1.3), "
        f"{swapped['seconds'] / plain['seconds']:.2f}x plain"
    )


if __name__ == "__main__":
    main()
