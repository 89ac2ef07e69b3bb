"""Peak GPU memory, step time, model TFLOP/s and MFU of a Flux-dev-sized LoRA step, with and without the memory savers.

    python bench/gpu_memory.py [--steps 20] [--swap 40] [--json out.json]   # one GPU: about 4 minutes on an H200
    python bench/gpu_memory.py --small --device cpu                         # a tiny Flux on CPU: the code path only

A diffusers ``FluxTransformer2DModel`` at Flux.1-dev's real dimensions (random bf16 weights, built on the device),
LoRA rank 16 on the usual targets, a 1024x1024 image (128x128 latents, 4096 image + 512 text tokens), run
through diffpipe's Flux pipeline layers and its memory wrappers (diffpipe_core.memory) in one process, so
the figures are those of the core's code without DeepSpeed's communication. Variants:

- plain: every weight resident, no checkpointing;
- checkpointing: ``activation_checkpointing = true``;
- swap + offload: ``blocks_to_swap = N`` and ``activation_checkpointing = "offload"``;
- nf4, float8: ``[model] quantize`` bases, otherwise as plain (so their peak differs from plain's by what
  quantizing the base saves, and by what the quantized linears keep for backward).

Per variant: peak memory allocated on the device during the steps (weights included), median step time (the
first step, which warms kernels and the allocator, left out), model TFLOP/s and MFU against the device's dense bf16
peak (``--peak-tflops``, else looked up by device name), the resident frozen base-weight bytes and every step's
loss (same batch each step: a LoRA that trains lowers it). Model FLOPs per step: 2 x parameters x tokens for the
forward and as much again for the backward's input gradients (frozen base weights get no weight gradient; LoRA's
are negligible), plus attention (4 x tokens^2 x width per block forward, twice that backward); the recomputation of
checkpointing is not model work, so it lowers MFU. Targets: plain MFU >= 40%; swap + offload peak <= 8 GB at <= 1.3x
plain's step time; nf4 and float8 peak below plain's by at least the base-weight bytes they save, losses finite and
falling. ``--json`` writes all of it (the keys are the same on CPU, where memory and MFU are null).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from diffpipe_core.adapters import apply_lora, lora_config
from diffpipe_core.atomic import atomic_write_text
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


BF16_PEAK_TFLOPS = {  # dense bf16 tensor-core peaks (no sparsity), TFLOP/s, by a substring of the device name
    "H200": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0, "GH200": 989.0, "B200": 2250.0,
    "A100": 312.0, "L40S": 362.0, "L40": 181.0, "A6000": 155.0, "RTX 4090": 165.0, "RTX 3090": 71.0,
}  # fmt: skip
VARIANTS = (  # name, activation checkpointing, swap the last --swap blocks, quantize
    ("plain", False, False, None),
    ("checkpointing", True, False, None),
    ("swap + offload", "offload", True, None),
    ("nf4", False, False, "nf4"),
    ("float8", False, False, "float8"),
)
RESULT_KEYS = ("peak_gb", "step_s", "tflops", "mfu", "base_weight_gb", "swapped_blocks", "losses")


def bf16_peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in TFLOP/s, or None (a CPU, or a GPU not in :data:`BF16_PEAK_TFLOPS`)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_TFLOPS.items() if key in name), None)


def model_flops(config: dict[str, Any], n_params: int, tokens: int) -> float:
    """Model FLOPs of one LoRA training step (see the module docstring)."""
    blocks = config["num_layers"] + config["num_single_layers"]
    width = config["num_attention_heads"] * config["attention_head_dim"]
    return 4 * n_params * tokens + 3 * blocks * 4 * tokens**2 * width


def frozen_base_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of the frozen base weights resident on ``device`` (nf4 block scales included; swapped blocks,
    held in host memory between uses, are not resident)."""
    total = 0
    for module in model.modules():
        tensors = [t for t in module.parameters(recurse=False) if not t.requires_grad] + list(module.buffers(False))
        total += sum(t.numel() * t.element_size() for t in tensors if t.device.type == device.type)
        absmax = getattr(getattr(getattr(module, "weight", None), "quant_state", None), "absmax", None)
        if torch.is_tensor(absmax) and absmax.device.type == device.type:
            total += absmax.numel() * absmax.element_size()
    return total


def run_variant(name: str, args: argparse.Namespace, device: torch.device, checkpointing: Any, swap: int,
                quantize: str | None, peak_tflops: float | None) -> dict[str, Any]:  # fmt: skip
    config = SMALL if args.small else FLUX_DEV
    model, layers, n_params = build(config, device, quantize)
    layers, swapped = wrap_stage_layers(layers, range(len(layers)), BLOCKS, checkpointing, swap, device)
    for layer in layers:
        layer.to(device)  # what PipelineModule does; swapped blocks' weights stay in host memory
    base_bytes = frozen_base_bytes(model, device)
    lora = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora, lr=args.lr)
    x, target = inputs(config, args.size, args.text_len, device)
    tokens = (args.size // 16) ** 2 + args.text_len
    times, losses = [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # the peak from here on counts the resident weights, not the build
    for step in range(args.steps + 1):
        start = time.perf_counter()
        out = x
        for layer in layers:
            out = layer(out)
        loss = torch.nn.functional.mse_loss(out[0].float(), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the step, as a synchronize would
        if step:  # the first step warms up kernels and allocator
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None
    tflops = model_flops(config, n_params, tokens) / seconds / 1e12
    mfu = tflops / peak_tflops if peak_tflops else None
    shown_peak = f"{peak:6.2f} GB" if peak is not None else "   n/a   "
    shown_mfu = f"{100 * mfu:5.1f}%" if mfu is not None else "  n/a"
    print(f"{name:<15} swapped {swapped:>3} blocks  peak {shown_peak}  step {seconds:7.3f} s  {tflops:8.3g} TFLOP/s  "
          f"MFU {shown_mfu}  base weights {base_bytes / 1e9:6.2f} GB  loss {losses[0]:.4g} -> {losses[-1]:.4g}",
          flush=True)  # fmt: skip
    del model, layers, optimizer, out, loss
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(zip(RESULT_KEYS, (peak, seconds, tflops, mfu, base_bytes / 1e9, swapped, losses)))


def falling(losses: list[float]) -> bool:
    """Finite, and the mean of the last quarter of the steps below that of the first quarter."""
    quarter = max(1, len(losses) // 4)
    return all(math.isfinite(v) for v in losses) and statistics.mean(losses[-quarter:]) < statistics.mean(
        losses[:quarter]
    )


def judge(results: dict[str, dict[str, Any]], device: torch.device) -> dict[str, dict[str, Any]]:
    """Each target with what was measured and whether it is met (None where a CPU does not measure it: memory,
    MFU, and step times, which are a GPU's targets)."""
    plain, swap = results["plain"], results["swap + offload"]
    slower = swap["step_s"] / plain["step_s"]
    targets: dict[str, dict[str, Any]] = {
        "plain MFU >= 40%": {"measured": plain["mfu"], "met": None if plain["mfu"] is None else plain["mfu"] >= 0.4},
        "swap + offload peak <= 8 GB": {
            "measured": swap["peak_gb"], "met": None if swap["peak_gb"] is None else swap["peak_gb"] <= 8.0,
        },
        "swap + offload step <= 1.3x plain": {
            "measured": slower, "met": slower <= 1.3 if device.type == "cuda" else None,
        },
    }  # fmt: skip
    for mode in ("nf4", "float8"):
        got = results[mode]
        saved = plain["base_weight_gb"] - got["base_weight_gb"]
        lower = None if got["peak_gb"] is None else plain["peak_gb"] - got["peak_gb"]
        targets[f"{mode} peak below plain's by >= the base bytes saved"] = {
            "measured": lower, "saved": saved, "met": None if lower is None else lower >= saved,
        }  # fmt: skip
        targets[f"{mode} loss finite and falling"] = {"measured": got["losses"], "met": falling(got["losses"])}
    return targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (after one warm-up step)")
    parser.add_argument("--swap", type=int, default=40, help="blocks_to_swap (of 57 Flux blocks)")
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels")
    parser.add_argument("--text-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3, help="LoRA AdamW learning rate")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when there is one")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (default: by its name)")
    parser.add_argument("--variants", help="comma-separated subset of: " + ", ".join(v[0] for v in VARIANTS))
    parser.add_argument("--small", action="store_true", help="tiny Flux: a check of the code path")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    if args.small:
        args.size, args.text_len, args.swap = 64, 16, 3
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    names = [v[0] for v in VARIANTS]
    chosen = names if not args.variants else [n.strip() for n in args.variants.split(",")]
    unknown = [n for n in chosen if n not in names]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; valid: {', '.join(names)}")
    peak_tflops = args.peak_tflops or bf16_peak_tflops(device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    size = "(small)" if args.small else "dev dimensions"
    print(f"device {device_name} (bf16 peak {peak_tflops or 'unknown'} TFLOP/s); Flux {size}; {args.size}^2 image; "
          f"{args.steps} steps", flush=True)  # fmt: skip
    report = {
        "device": device_name, "bf16_peak_tflops": peak_tflops, "small": args.small, "size": args.size,
        "text_len": args.text_len, "steps": args.steps, "swap": args.swap, "variants": {}, "targets": {},
    }  # fmt: skip
    results: dict[str, dict[str, Any]] = report["variants"]
    for name, checkpointing, swap, quantize in VARIANTS:
        if name in chosen:
            results[name] = run_variant(name, args, device, checkpointing, args.swap if swap else 0, quantize,
                                        peak_tflops)  # fmt: skip
            if args.json:  # after each variant: a run stopped by a time limit keeps what it measured
                atomic_write_text(args.json, json.dumps(report, indent=1))
    targets = report["targets"] = judge(results, device) if len(results) == len(VARIANTS) else {}
    for target, got in targets.items():
        shown = got["measured"] if not isinstance(got["measured"], list) else "losses above"
        print(f"target {target}: {'met' if got['met'] else 'not measured' if got['met'] is None else 'NOT met'} "
              f"({shown})", flush=True)  # fmt: skip
    if args.json:
        atomic_write_text(args.json, json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
