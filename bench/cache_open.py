"""Time to open a fully cached dataset of 100,000 real image files, on both paths.

    python bench/cache_open.py [--files 100000] [--data DIR] [--pairs 3] [--rows-per-shard 64]

The images and captions are generated once into ``DIR`` (see ``bench/scan.py``). The cache is made by the
real ``prepare_cache`` (real scan, real cache keys, real index), except that encoding is replaced by writing
random tensors of the reference model's shapes (latents (4, h/8, w/8), text embeddings (16, 32)), so no file is
decoded. Then the two ways of opening it are timed, alternated in pairs (``--pairs``, at least 3; each pair
starts with the other side):

- ``trust_cache=True``: reads the cache index without looking at the files;
- the default: re-scans the dataset through the scan index (one ``stat`` per media and caption file), checks
  the encoder files' identity, and opens the cache only if nothing changed (target <= 5 s).

Also timed: the sampler's setup and collating micro-batches.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from media_set import cpu_seconds, default_folder, ensure_media_set, load_line, spread  # noqa: E402

from diffpipe_core.data import BucketSampler, prepare_cache  # noqa: E402
from diffpipe_core.data import cache as cache_module  # noqa: E402
from diffpipe_core.data.cache_store import write_shard  # noqa: E402
from diffpipe_core.registry import Registry  # noqa: E402
from diffpipe_core.testing.bench import alternate, ratio_report  # noqa: E402
from diffpipe_core.testing.media import write_dataset_toml  # noqa: E402
from diffpipe_reference import plugin as reference_plugin  # noqa: E402
from diffpipe_reference.model import write_tiny_model  # noqa: E402


def synthesising_encoder(rows_per_shard: int):
    """A stand-in for ``cache._encode_share`` that writes random tensors for the work it is given."""

    def encode_share(plugin, model_config, spec, fp_dir, rank, my_media, my_captions, texts, *args, **kwargs):
        g = torch.Generator().manual_seed(rank)
        by_bucket: dict = {}
        for work in my_media:
            by_bucket.setdefault(work.item.bucket, []).append(work.key)
        for bucket, keys in by_bucket.items():
            for i in range(0, len(keys), rows_per_shard):
                part = keys[i : i + rows_per_shard]
                latents = torch.randn(len(part), 4, bucket.height // 8, bucket.width // 8, generator=g)
                write_shard(fp_dir / "media", f"r{rank:03d}-bench", part, {"latents": latents})
        for i in range(0, len(my_captions), rows_per_shard):
            part = my_captions[i : i + rows_per_shard]
            write_shard(fp_dir / "captions", f"r{rank:03d}-bench", part,
                        {"text_embeds": torch.randn(len(part), 16, 32, generator=g)})
        return len(my_media), []

    return encode_share


def refuse_to_encode(*args, **kwargs):
    raise AssertionError("the cache should be complete: opening it must not encode anything")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--data", type=Path, default=None, help="where the generated images live (reused)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rows-per-shard", type=int, default=64)
    args = parser.parse_args()

    data = ensure_media_set(args.data or default_folder(args.files), args.files)
    tmp = Path(tempfile.mkdtemp(prefix="diffpipe-open-"))
    try:
        toml = write_dataset_toml(tmp / "dataset.toml", data, resolutions=[64], enable_ar_bucket=True,
                                  num_ar_buckets=5, cache_dir=tmp / "cache")
        registry = Registry()
        registry.register_model("reference", reference_plugin)
        plugin = registry.model("reference")
        config = plugin.spec.config_schema(type="reference", path=write_tiny_model(tmp / "model"))

        cache_module._encode_share = synthesising_encoder(args.rows_per_shard)
        t0 = time.perf_counter()
        made = prepare_cache(toml, plugin, config, progress=False)
        made_s = time.perf_counter() - t0
        assert made.summary["encoded_media"] == args.files, made.summary
        cache_module._encode_share = refuse_to_encode
        recomputed: list[str] = []  # cache keys computed by the opens below: none if the index was used
        real_media_key = cache_module.media_key
        cache_module.media_key = lambda item, *a: recomputed.append(item.id) or real_media_key(item, *a)

        times: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}
        opened = []

        def open_cache(trust: bool) -> float:
            c0, t0 = cpu_seconds(), time.perf_counter()
            ds = prepare_cache(toml, plugin, config, trust_cache=trust, progress=False)
            times[trust].append(time.perf_counter() - t0)
            cpu[trust].append(cpu_seconds() - c0)
            assert len(ds) == args.files and ds.summary["encoded_media"] == 0
            opened.append(ds)
            return times[trust][-1]

        pairs = alternate(lambda: open_cache(False), lambda: open_cache(True), args.pairs)
        ds = opened[-1]
        assert not recomputed, f"the default path recomputed {len(recomputed)} cache keys instead of using the index"

        t0 = time.perf_counter()
        sampler = BucketSampler(ds.groups(), 4, 0, 1, seed=0)
        first = next(iter(sampler))
        grouped = time.perf_counter() - t0
        t0 = time.perf_counter()
        batch = ds.collate(first, torch.Generator().manual_seed(0))
        collated = time.perf_counter() - t0
        assert batch["latents"].shape[0] == 4
        collate_times = []
        for _ in range(2):  # the first pass opens shards as it meets them; the second has them open
            t0 = time.perf_counter()
            for i, mb in enumerate(sampler):
                ds.collate(mb)
                if i == 199:
                    break
            collate_times.append((time.perf_counter() - t0) / 200)
            sampler.set_epoch(0)
            sampler.position = 0

        shards = len(ds._media_shards) + len(ds._caption_shards)
        print(f"{args.files} images with captions, {len(ds.groups())} buckets, {shards} shards "
              f"({args.rows_per_shard} rows each); scanned, planned and synthesised in {made_s:.1f} s")
        print("seconds: wall (CPU)")
        print(f"open, default (files and encoders checked): {spread(times[False])}  ({spread(cpu[False])})  "
              "target <= 5 s")
        print(f"open, trust_cache=True:                     {spread(times[True])}  ({spread(cpu[True])})")
        print("  " + ratio_report(pairs, "wall default / trust_cache"))
        print(f"groups + sampler + first order:             {grouped:6.2f} s")
        print(f"first collate (4 samples):                  {collated * 1000:6.1f} ms")
        print(f"collate, mean of 200 micro-batches:         {collate_times[0] * 1000:6.1f} ms (shards opened on the "
              f"way), {collate_times[1] * 1000:.2f} ms (open)")
        print(load_line())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
