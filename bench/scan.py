"""Scanning a dataset of 100,000 generated images with captions: first scan, and re-scans through the scan index.

    python bench/scan.py [--files 100000] [--data DIR] [--pairs 3] [--rescans 5]

Reports
- the first scan (every file probed, every caption read) on 1 worker and on all cores, alternated in pairs
  (``--pairs``, at least 3; each pair starts with the other side), with the median ratio and its spread;
- a re-scan with nothing changed (one ``stat`` a file; target <= 3 s on 2 cores);
- a re-scan after touching 1% of the media files (a new mtime: those are probed again).

The images are generated once into ``DIR`` (default: the system temp folder) and reused by later runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from media_set import cpu_seconds, default_folder, ensure_media_set, load_line, media_paths, spread  # noqa: E402

from diffpipe_core.data.dataset_config import load_dataset_config  # noqa: E402
from diffpipe_core.data.scan import scan_dataset  # noqa: E402
from diffpipe_core.testing.bench import alternate, ratio_report  # noqa: E402
from diffpipe_core.testing.media import write_dataset_toml  # noqa: E402
from diffpipe_core.types import ModelConfigBase, ModelSpec  # noqa: E402

SPEC = ModelSpec(name="bench", modality="image", config_schema=ModelConfigBase, spatial_multiple=16)


CPU: list[float] = []  # CPU seconds of each timed scan, this process and its workers


def timed_scan(toml: Path, workers: int | None) -> tuple[float, dict[str, int], int]:
    """Wall seconds of one scan (its CPU seconds go to ``CPU``: on a shared machine wall time also counts
    the time other processes held the cores)."""
    cfg = load_dataset_config(toml)
    c0, t0 = cpu_seconds(), time.perf_counter()
    result = scan_dataset(cfg, SPEC, workers=workers, progress=False)
    seconds = time.perf_counter() - t0
    CPU.append(cpu_seconds() - c0)
    return seconds, result.stats, len(result.items)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--data", type=Path, default=None, help="where the generated images live (reused)")
    parser.add_argument("--pairs", type=int, default=3, help="first-scan pairs (1 worker, all cores)")
    parser.add_argument("--rescans", type=int, default=5)
    args = parser.parse_args()

    data = ensure_media_set(args.data or default_folder(args.files), args.files)
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="diffpipe-scan-bench-", ignore_cleanup_errors=True) as name:
        tmp = Path(name)
        first: dict[int, list[float]] = {1: [], cores: []}
        first_cpu: dict[int, list[float]] = {1: [], cores: []}
        tomls: list[Path] = []

        def first_scan(workers: int) -> float:
            cache = tmp / f"cache-{len(tomls)}"  # an empty cache folder: no scan index yet
            tomls.append(write_dataset_toml(tmp / f"dataset-{len(tomls)}.toml", data, resolutions=[64],
                                            enable_ar_bucket=True, num_ar_buckets=5, cache_dir=cache))
            seconds, stats, items = timed_scan(tomls[-1], workers)
            assert stats["read"] == 2 * args.files and items == args.files, (stats, items)
            first[workers].append(seconds)
            first_cpu[workers].append(CPU[-1])
            print(f"first scan, {workers} worker(s): {seconds:6.1f} s wall, {CPU[-1]:6.1f} s CPU")
            return seconds

        pairs = alternate(lambda: first_scan(1), lambda: first_scan(cores), args.pairs)
        toml = tomls[-1]
        unchanged, unchanged_cpu = [], []
        for _ in range(args.rescans):
            seconds, stats, items = timed_scan(toml, None)
            assert stats["read"] == 0 and items == args.files, stats
            unchanged.append(seconds)
            unchanged_cpu.append(CPU[-1])

        touched, touched_cpu = [], []
        paths = media_paths(data, args.files)
        for k in range(3):
            chosen = paths[k :: 100]
            for path in chosen:
                st = path.stat()
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
            seconds, stats, items = timed_scan(toml, None)
            assert stats["read"] == len(chosen) and items == args.files, stats
            touched.append(seconds)
            touched_cpu.append(CPU[-1])

        index = next((load_dataset_config(toml).cache_dir / "scan").glob("*.json"))
        size = index.stat().st_size / 2**20
        print(f"\n{args.files} images + {args.files} captions, {cores} cores; scan index {size:.1f} MiB")
        print("seconds: wall (CPU of this process and its workers)")
        print(f"first scan, 1 worker:         {spread(first[1])}  ({spread(first_cpu[1])})")
        print(f"first scan, {cores} workers:        {spread(first[cores])}  ({spread(first_cpu[cores])})")
        print("  " + ratio_report(pairs, f"wall 1 worker / {cores} workers"))
        print(f"re-scan, nothing changed:     {spread(unchanged)}  ({spread(unchanged_cpu)})  target <= 3 s")
        print(f"re-scan, 1% touched:          {spread(touched)}  ({spread(touched_cpu)})  "
              f"{len(paths[::100])} files read again")
        print(load_line())


if __name__ == "__main__":
    main()
