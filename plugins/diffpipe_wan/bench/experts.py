"""Wan 2.2 A14B with both experts in one run: the figures behind the README's choice of stage layout.

    python plugins/diffpipe_wan/bench/experts.py [--steps 20] [--draws 200000]

1. The share of training samples each expert gets (the core's logit-normal times, shifted as the released folders
   shift them: T2V A14B flow_shift 12 with boundary_ratio 0.875, I2V A14B flow_shift 5 with boundary_ratio 0.9).
   With one expert per stage group, the group of the smaller share waits for the other one.
2. On CPU, forward + backward of a micro-batch of 2 through both experts' layers (``expert = "both"``, every stage
   holding both experts' blocks) against the same through one expert's layers, for micro-batches of one expert and
   of both: what holding both experts costs in time (it costs memory, which the GPU-fit plan counts).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from diffpipe_core.diffusion import sample_timesteps
from diffpipe_core.schema import validate
from diffpipe_wan.plugin import wan
from diffpipe_wan.testing import TinyWanConfig, write_tiny_wan

RELEASED = {"T2V A14B": (12.0, 0.875), "I2V A14B": (5.0, 0.9)}
MODEL = TinyWanConfig(num_layers=4, num_attention_heads=4, attention_head_dim=64, latent_channels=16, text_dim=64,
                      ffn_dim=512, boundary_ratio=0.875)  # fmt: skip


def high_share(shift: float, boundary: float, draws: int) -> float:
    t = sample_timesteps(draws, torch.Generator().manual_seed(0), "logit_normal", 1.0, shift)
    return float((t >= boundary).float().mean())


def step_seconds(layers: list, inputs: tuple, steps: int) -> float:
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        out = inputs
        for layer in layers:
            out = layer(out)
        out[0].square().mean().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--draws", type=int, default=200_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, (shift, boundary) in RELEASED.items():
        share = high_share(shift, boundary, args.draws)
        print(f"{name}: shift {shift:g}, boundary {boundary:g}: high-noise expert {share:.1%} of samples, "
              f"low-noise {1 - share:.1%}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_wan(Path(tmp) / "a14b", MODEL)
        table = {"type": "wan", "path": folder, "dtype": "float32", "text_max_length": 64}
        both_cfg = validate(wan.spec.config_schema, table, "bench")
        one_cfg = validate(wan.spec.config_schema, {**table, "expert": "high"}, "bench")
        both = wan.load_diffusion_model(both_cfg, torch.device("cpu"), torch.float32)
        one = wan.load_diffusion_model(one_cfg, torch.device("cpu"), torch.float32)
        g = torch.Generator().manual_seed(0)
        x, text = torch.randn(2, 16, 5, 16, 24, generator=g), torch.randn(2, 64, 64, generator=g)
        one_layers, both_layers = wan.split_into_layers(one, one_cfg), wan.split_into_layers(both, both_cfg)
        single = step_seconds(one_layers, (x, torch.tensor([0.9, 0.95]), text), args.steps)
        same = step_seconds(both_layers, (x, torch.tensor([0.9, 0.95]), text, torch.tensor([0, 0])), args.steps)
        mixed = step_seconds(both_layers, (x, torch.tensor([0.9, 0.3]), text, torch.tensor([0, 1])), args.steps)
    print(f"CPU, 1 thread, micro-batch of 2 (480 video + 64 text tokens each), forward + backward, median of "
          f"{args.steps}: one expert {single * 1000:.0f} ms; both experts held, one expert's samples "
          f"{same * 1000:.0f} ms ({same / single:.2f}x); one sample of each {mixed * 1000:.0f} ms "
          f"({mixed / single:.2f}x)")


if __name__ == "__main__":
    main()
