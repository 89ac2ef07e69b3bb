"""What the workers' fixed mmap threshold costs a CPU step (issue 46: engine/host_memory.py).

    python bench/allocator_cost.py [--pairs 3] [--steps 12] [--dim 1024] [--depth 12] [--size 256] [--batch 1]

Every diffpipe worker fixes glibc's mmap threshold at 128 KiB, so the tensors a step frees go back to the system
(each larger allocation its own mapping) instead of staying in the heap. A CPU step then faults its activations in
anew. This bench times the plain PyTorch training loop of ``bench/overhead.py`` (the reference DiT with a rank-16
LoRA and AdamW, bfloat16 as users train) in a fresh process with ``MALLOC_MMAP_THRESHOLD_=131072`` (what a worker
sets) and one without (glibc's growing threshold), alternating in pairs; it reports the median ratio (fixed /
growing) of the median step time and of the process's CPU seconds per step (user + system: less sensitive to a
loaded machine than the wall clock). A GPU run's steps allocate little host memory, so this is the CPU's cost only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from diffpipe_core.testing import bench

CHILD = """
import json, resource, statistics, sys, torch
sys.path.insert(0, {bench_dir!r})
from overhead import TARGETS
from diffpipe_core.testing import bench
from diffpipe_reference.model import TinyDiT, TinyDiTConfig
torch.set_num_threads(1)
cfg = TinyDiTConfig(dim={dim}, depth={depth}, heads=8)
torch.manual_seed(0)
model = TinyDiT(cfg).to(torch.bfloat16)
side = {size} // cfg.vae_factor
latents = torch.randn({batch}, cfg.in_channels, side, side, dtype=torch.bfloat16)
text = torch.randn({batch}, cfg.text_len, cfg.text_dim, dtype=torch.bfloat16)
before = resource.getrusage(resource.RUSAGE_SELF)
bf16 = torch.bfloat16
loss = bench.flow_loss(latents, lambda x, t: model(x.to(bf16), t.to(bf16), text))
times = bench.plain_step_times(model, TARGETS, loss, {steps})
after = resource.getrusage(resource.RUSAGE_SELF)
cpu = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / {steps}
faults = (after.ru_minflt - before.ru_minflt) / {steps}
print(json.dumps({{"step": statistics.median(times[{warmup}:]), "cpu": cpu, "faults": faults}}))
"""


def run_side(fixed: bool, args: object) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if fixed:
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 2**10)
    code = CHILD.format(bench_dir=str(Path(__file__).parent), **vars(args))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.exit(f"the {'fixed' if fixed else 'growing'} side failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = bench.bench_parser(steps=12, warmup=2, batch=1)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--size", type=int, default=256)
    args = parser.parse_args()
    smoke = args.__dict__.pop("smoke")
    pairs_wanted = args.__dict__.pop("pairs")
    print(f"model: TinyDiT dim={args.dim} depth={args.depth} bfloat16, {args.size}px, batch {args.batch}, LoRA r=16, "
          f"1 thread; fixed threshold (128 KiB) / glibc's growing one; load {os.getloadavg()[0]:.1f}", flush=True)
    results: dict[str, list[tuple[float, float]]] = {"step": [], "cpu": [], "faults": []}

    def report(i: int, fixed: dict, growing: dict) -> None:
        print(f"pair {i + 1}: step {fixed['step'] * 1000:.0f} / {growing['step'] * 1000:.0f} ms, CPU "
              f"{fixed['cpu'] * 1000:.0f} / {growing['cpu'] * 1000:.0f} ms, minor faults {fixed['faults']:.0f} / "
              f"{growing['faults']:.0f} per step (load {os.getloadavg()[0]:.1f})", flush=True)
        for key in results:
            results[key].append((fixed[key], growing[key]))

    sides = (lambda: run_side(True, args), lambda: run_side(False, args))
    for i in range(1 if smoke else max(3, pairs_wanted)):
        first, second = sides if i % 2 == 0 else sides[::-1]
        a, b = first(), second()
        fixed, growing = (a, b) if i % 2 == 0 else (b, a)
        report(i, fixed, growing)
    if not smoke:
        for key, what in (("step", "step time"), ("cpu", "CPU seconds per step"), ("faults", "minor faults")):
            print(bench.ratio_report(results[key], f"{what} (fixed / growing)"))


if __name__ == "__main__":
    main()
