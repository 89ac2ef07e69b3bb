"""Step time of a full fine-tune with ``[optimizer] offload = true`` against the plain optimizer.

    python bench/optimizer_offload.py [--pairs 5] [--steps 10] [--optimizer adamw] [--dim 512] [--depth 8]

The reference plugin's diffusion transformer (random weights, ``--dim`` wide, ``--depth`` blocks), every weight
trained, on the GPU when there is one (else the CPU): forward, backward and the optimizer step on one random batch,
``--steps`` steps per measurement, the two sides measured in alternating pairs (:mod:`diffpipe_core.testing.bench`).
Printed: each pair's seconds per step, the median ratio offload / plain with its spread, and the optimizer state's
bytes that offload keeps off the device. On a CPU both sides' state is in the same memory, so the ratio there is
the cost of stepping one parameter at a time, without the host-device copies a GPU adds.
"""

from __future__ import annotations

import argparse
import time

import torch

from diffpipe_core.config import OptimizerConfig
from diffpipe_core.optim import build_optimizer
from diffpipe_core.optim.offload import offload_state
from diffpipe_core.registry import get_registry
from diffpipe_core.testing.bench import alternate, ratio_report


def build(kind: str, dim: int, depth: int, device: torch.device, offload: bool):
    from diffpipe_reference.model import TinyDiT, TinyDiTConfig

    torch.manual_seed(0)
    model = TinyDiT(TinyDiTConfig(dim=dim, depth=depth, heads=max(1, dim // 64))).to(device)
    optimizer = build_optimizer(OptimizerConfig(type=kind, lr=1e-5), list(model.parameters()), get_registry().pm)
    return model, offload_state(optimizer) if offload else optimizer


def seconds_per_step(model, optimizer, inputs, steps: int, device: torch.device) -> float:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(*inputs).float().square().mean().backward()
        optimizer.step()

    step()  # state allocated, kernels warm
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    plain = build(args.optimizer, args.dim, args.depth, device, offload=False)
    offloaded = build(args.optimizer, args.dim, args.depth, device, offload=True)
    config = plain[0].config
    inputs = (torch.randn(2, config.in_channels, 32, 32, device=device), torch.rand(2, device=device),
              torch.randn(2, config.text_len, config.text_dim, device=device))
    params = sum(p.numel() for p in plain[0].parameters())
    print(f"{args.optimizer} over {params / 1e6:.1f} M trainable float32 weights on {device}, {args.steps} steps a "
          f"measurement; offload keeps {params * 8 / 2**20:.0f} MiB of optimizer state off the device", flush=True)
    pairs = alternate(
        lambda: seconds_per_step(*offloaded, inputs, args.steps, device),
        lambda: seconds_per_step(*plain, inputs, args.steps, device),
        args.pairs,
        lambda i, a, b: print(f"pair {i + 1}: offload {a:.4f} s/step, plain {b:.4f} s/step", flush=True),
    )
    print(ratio_report(pairs, "step time offload / plain"))


if __name__ == "__main__":
    main()
