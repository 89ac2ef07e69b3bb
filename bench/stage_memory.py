"""Host memory per rank with 2 pipeline stages against 1: what per-stage loading saves.

    python bench/stage_memory.py [--dim 1536] [--depth 12] [--pairs 2]

Writes a reference model of several hundred MB (random weights, its real on-disk format), then runs
`diffpipe train` for one step with 1 stage on 1 process and with 2 stages on 2 processes, alternately, sampling
every worker's anonymous RSS (``RssAnon`` in /proc/PID/status, so memory-mapped weight files don't count) and
keeping each worker's peak. An idle worker's baseline (the same run on the default tiny reference model) is
subtracted to give the model's share. Target for the model's share of a 2-stage rank: <= 0.55 of 1 stage.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_core.testing.processes import kill_group, start_diffpipe
from diffpipe_reference.model import TinyDiTConfig, write_tiny_model

RUN = """
output_dir = "out"
dataset = "{dataset}"
max_steps = 1
micro_batch_size_per_gpu = 1
pipeline_stages = {stages}
[model]
type = "reference"
path = "{model}"
dtype = "bfloat16"
[adapter]
rank = 4
"""


def rss_anon(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def peak_worker_rss(root: Path, model: Path, dataset: Path, stages: int, timeout: float = 900) -> int:
    """The largest peak anonymous RSS of any worker of one `diffpipe train` run."""
    config = root / f"run{stages}.toml"
    config.write_text(RUN.format(dataset=dataset, model=model, stages=stages))
    proc = start_diffpipe(["train", "--config", str(config), "--num-procs", str(stages)], cwd=root)
    peaks: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if "diffpipe_core.engine.worker" in " ".join(child.cmdline()):
                        peaks[child.pid] = max(peaks.get(child.pid, 0), rss_anon(child.pid))
                except psutil.NoSuchProcess:
                    continue
            time.sleep(0.02)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"diffpipe train ({stages} stages) failed:\n{out[-2000:]}\n{err[-3000:]}")
    return max(peaks.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="diffpipe-stage-memory-") as tmp:
        root = Path(tmp)
        big = write_tiny_model(root / "big", TinyDiTConfig(dim=args.dim, depth=args.depth, heads=16))
        tiny = write_tiny_model(root / "tiny")
        size = (big / "transformer.safetensors").stat().st_size
        write_image_dataset(root / "images", 2, size=(64, 64))
        write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[64])
        dataset = root / "dataset.toml"
        print(f"model: {size / 2**20:.0f} MiB of float32 weights on disk, trained in bfloat16", flush=True)
        baseline = peak_worker_rss(root, tiny, dataset, 1)
        print(f"idle worker baseline (tiny model, 1 stage): {baseline / 2**20:.0f} MiB", flush=True)
        raw, share = [], []
        for pair in range(args.pairs):
            one = peak_worker_rss(root, big, dataset, 1)
            two = peak_worker_rss(root, big, dataset, 2)
            raw.append(two / one)
            share.append((two - baseline) / (one - baseline))
            print(
                f"pair {pair + 1}: 1 stage {one / 2**20:.0f} MiB, 2 stages {two / 2**20:.0f} MiB per rank (peak); "
                f"raw {raw[-1]:.3f}, model's share {share[-1]:.3f}",
                flush=True,
            )
        print(
            f"2 stages / 1 stage, peak anonymous RSS per rank: raw {statistics.median(raw):.3f} "
            f"(spread {min(raw):.3f}-{max(raw):.3f}); model's share {statistics.median(share):.3f} "
            f"(spread {min(share):.3f}-{max(share):.3f}); target for the share <= 0.55"
        )


if __name__ == "__main__":
    sys.exit(main())
