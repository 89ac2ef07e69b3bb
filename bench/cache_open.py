"""Time to open a cache of 100,000 items (synthesised), target under 10 s.

    python bench/cache_open.py [--items 100000] [--rows-per-shard 64] [--buckets 7]

Writes shards exactly as caching does (latents (4, 32, 32) for 256x256 images and text embeddings
(16, 32), one caption per item, ``rows-per-shard`` rows per shard = the default 16 batches of 4) plus
the dataset index, then times ``prepare_cache(trust_cache=True)`` (the path that skips checking every
file), the sampler's setup, and the first micro-batch.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

from diffpipe_core.data import BucketSampler, prepare_cache  # noqa: E402
from diffpipe_core.data.cache import CacheEntry, _write_index, cache_root  # noqa: E402
from diffpipe_core.data.cache_keys import encoder_fingerprint  # noqa: E402
from diffpipe_core.data.cache_store import write_shard  # noqa: E402
from diffpipe_core.data.items import Bucket  # noqa: E402
from diffpipe_core.registry import Registry  # noqa: E402
from diffpipe_core.testing.media import write_dataset_toml  # noqa: E402
from diffpipe_reference import plugin as reference_plugin  # noqa: E402
from diffpipe_reference.model import write_tiny_model  # noqa: E402


def synthesise(fp_dir: Path, n: int, rows: int, buckets: list[Bucket]) -> list[CacheEntry]:
    entries = []
    g = torch.Generator().manual_seed(0)
    per_bucket = -(-n // len(buckets))
    for b, bucket in enumerate(buckets):
        count = min(per_bucket, n - b * per_bucket)
        for start in range(0, count, rows):
            m = min(rows, count - start)
            ids = [f"b{b}/img_{start + j:06d}.png" for j in range(m)]
            media = [hashlib.sha256(f"m{i}".encode()).hexdigest() for i in ids]
            caps = [hashlib.sha256(f"c{i}".encode()).hexdigest() for i in ids]
            h, w = bucket.height // 8, bucket.width // 8
            write_shard(fp_dir / "media", "r000-bench", media, {"latents": torch.randn(m, 4, h, w, generator=g)})
            write_shard(fp_dir / "captions", "r000-bench", caps, {"text_embeds": torch.randn(m, 16, 32, generator=g)})
            entries += [CacheEntry(i, bucket, 1, mk, (ck,)) for i, mk, ck in zip(ids, media, caps)]
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--rows-per-shard", type=int, default=64)
    parser.add_argument("--buckets", type=int, default=7)
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="diffpipe-open-"))
    try:
        (tmp / "data").mkdir()
        toml = write_dataset_toml(tmp / "dataset.toml", tmp / "data", resolutions=[256])
        registry = Registry()
        registry.register_model("reference", reference_plugin)
        plugin = registry.model("reference")
        config = plugin.spec.config_schema(type="reference", path=write_tiny_model(tmp / "model"))
        fp = encoder_fingerprint(plugin.name, plugin.version, config, plugin.spec.encoder_settings)
        root = cache_root(tmp / "cache", plugin.name, toml)
        sizes = [(256, 256), (288, 224), (224, 288), (320, 192), (192, 320), (352, 176), (176, 352)]
        buckets = [Bucket(w, h) for w, h in (sizes * args.buckets)[: args.buckets]]
        t0 = time.perf_counter()
        entries = synthesise(root / fp[:16], args.items, args.rows_per_shard, buckets)
        _write_index(root / "index.json", fp, entries, [])
        made = time.perf_counter() - t0
        shards = len(list((root / fp[:16] / "media").iterdir())) * 2

        t0 = time.perf_counter()
        ds = prepare_cache(toml, plugin, config, trust_cache=True, progress=False)
        opened = time.perf_counter() - t0
        t0 = time.perf_counter()
        sampler = BucketSampler(ds.groups(), 4, 0, 1, seed=0)
        first = next(iter(sampler))
        grouped = time.perf_counter() - t0
        t0 = time.perf_counter()
        batch = ds.collate(first, torch.Generator().manual_seed(0))
        collated = time.perf_counter() - t0
        times = []
        for _ in range(2):  # the first pass opens shards as it meets them; the second has them open
            t0 = time.perf_counter()
            for i, mb in enumerate(sampler):
                ds.collate(mb)
                if i == 199:
                    break
            times.append((time.perf_counter() - t0) / 200)
            sampler.set_epoch(0)
            sampler.position = 0
        assert len(ds) == args.items and batch["latents"].shape[0] == 4
        print(
            f"{args.items} items in {shards} shards ({args.rows_per_shard} rows each), {len(buckets)} buckets; "
            f"synthesised in {made:.1f} s"
        )
        print(f"open (prepare_cache, trust_cache=True): {opened:6.2f} s  (target < 10 s)")
        print(f"groups + sampler + first order:         {grouped:6.2f} s")
        print(f"first collate (4 samples):              {collated * 1000:6.1f} ms")
        print(
            f"collate, mean of 200 micro-batches:     {times[0] * 1000:6.1f} ms (shards opened on the way), "
            f"{times[1] * 1000:.2f} ms (open)"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
