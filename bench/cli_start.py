"""Wall time of the commands that should answer at once: ``diffpipe --help``, ``models``, ``validate`` on the
demo config, and ``config-reference``; each the median of 5 runs (target <= 1.5 s).

    python bench/cli_start.py [--runs 5]

The demo config is the Flux demo's (``diffpipe_flux/examples/run.toml`` with its sample dataset), pointed at a
tiny Flux written into a temporary folder. For scale it also times a bare interpreter and ``import torch``.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DIFFPIPE = Path(sys.executable).with_name("diffpipe")


def demo_config(tmp: Path) -> Path:
    """The Flux demo config and dataset TOML, copied with absolute paths to a tiny Flux and the sample images."""
    subprocess.run([sys.executable, "-m", "diffpipe_flux.testing", str(tmp / "flux-tiny")], check=True,
                   capture_output=True, timeout=600)
    examples = REPO / "diffpipe_flux" / "examples"
    run = (examples / "run.toml").read_text()
    run = run.replace('"../../demo/flux-runs"', f'"{tmp / "runs"}"').replace('"../../demo/flux-tiny"',
                                                                            f'"{tmp / "flux-tiny"}"')
    dataset = (examples / "dataset.toml").read_text()
    dataset = dataset.replace('"../../demo/flux-cache"', f'"{tmp / "cache"}"')
    dataset = dataset.replace('"../../examples/sample_dataset"', f'"{REPO / "examples" / "sample_dataset"}"')
    (tmp / "dataset.toml").write_text(dataset)
    (tmp / "run.toml").write_text(run)
    return tmp / "run.toml"


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(cmd: list[str], runs: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of each run (on a shared machine wall time also counts others' use of the cores)."""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    wall, cpu = [], []
    for _ in range(runs):
        c0, t0 = _children_cpu(), time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        wall.append(time.perf_counter() - t0)
        cpu.append(_children_cpu() - c0)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="diffpipe-cli-bench-"))
    try:
        config = demo_config(tmp)
        rows = {
            "diffpipe --help": [str(DIFFPIPE), "--help"],
            "diffpipe models": [str(DIFFPIPE), "models"],
            "diffpipe validate (demo)": [str(DIFFPIPE), "validate", "--config", str(config)],
            "diffpipe config-reference": [str(DIFFPIPE), "config-reference"],
            "(python -c pass)": [sys.executable, "-c", "pass"],
            "(python -c 'import torch')": [sys.executable, "-c", "import torch"],
        }
        results = {name: timed(cmd, args.runs) for name, cmd in rows.items()}
        print(f"seconds, median of {args.runs} (min, max): wall, and CPU; target <= 1.5 s wall")
        for name, (wall, cpu) in results.items():
            print(f"{name:28s} wall {statistics.median(wall):5.2f} ({min(wall):.2f}, {max(wall):.2f})   "
                  f"CPU {statistics.median(cpu):5.2f} ({min(cpu):.2f}, {max(cpu):.2f})")
        print(f"load while measuring: {os.getloadavg()[0]:.1f} runnable processes on "
              f"{len(os.sched_getaffinity(0))} cores (1-minute average)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
