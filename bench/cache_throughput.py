"""Caching throughput with a tiny VAE and text encoder, and the framework's share of it.

    python bench/cache_throughput.py [--images 128] [--size 256] [--batch-size 8] [--workers N]
                                     [--encoder-ms 0] [--vae diffusers|reference]

By default the VAE is a tiny real diffusers AutoencoderKL (4 down blocks, 32-64 channels) and the text
encoder the reference model's byte encoder.

Times a full ``prepare_cache`` on a fresh cache (scan, decode and resize in DataLoader workers, bucketing,
encode, shard writing, opening) and, separately, the plugin's ``encode_batch`` alone on the same decoded
tensors and captions in the same batches. Prints both and their ratio (target <= 1.25), plus the scan and
single-threaded decode times for context.

The reference model's pooling "VAE" (--vae reference) costs far less than decoding a PNG, so with it the
ratio measures decoding,
not the framework. ``--encoder-ms`` adds that many milliseconds of device-like wait per media sample
inside encode_batch (a wrapper plugin; the CPU is free meanwhile, as with a VAE on a GPU), which shows
whether decoding and writing hide behind encoding.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

from diffpipe_core import hookimpl  # noqa: E402
from diffpipe_core.data import prepare_cache  # noqa: E402
from diffpipe_core.data.cache_encode import MediaWork, media_batches  # noqa: E402
from diffpipe_core.data.dataset_config import load_dataset_config  # noqa: E402
from diffpipe_core.data.decode import load_media  # noqa: E402
from diffpipe_core.data.scan import scan_dataset  # noqa: E402
from diffpipe_core.registry import Registry  # noqa: E402
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset  # noqa: E402
from diffpipe_core.types import EncodeBatch  # noqa: E402
from diffpipe_reference import plugin as reference_plugin  # noqa: E402
from diffpipe_reference.model import write_tiny_model  # noqa: E402


class DiffusersVAE:
    """The reference model with a real (tiny) diffusers AutoencoderKL as its VAE: a VAE whose cost has the
    shape of a real one (convolutions at full resolution), unlike the reference model's pooling stand-in."""

    def __init__(self) -> None:
        from diffusers import AutoencoderKL

        torch.manual_seed(0)
        self.vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            block_out_channels=(32, 64, 64, 64),
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=1,
            norm_num_groups=32,
        ).eval()

    @hookimpl(wrapper=True)
    def encode_batch(self, encoders, batch: EncodeBatch):
        out = yield
        if batch.pixels is not None:
            with torch.no_grad():
                out["latents"] = self.vae.encode(batch.pixels.float()).latent_dist.mean
        return out


class DeviceWait:
    """Stands in for a heavier encoder: waits ``ms`` per media sample, leaving the CPU free."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    @hookimpl(wrapper=True)
    def encode_batch(self, encoders, batch: EncodeBatch):
        if batch.pixels is not None:
            time.sleep(self.ms * batch.pixels.shape[0] / 1000)
        return (yield)


def encoders_alone(plugin, config, toml: Path, batch_size: int) -> tuple[float, int, float, float]:
    """Seconds spent in encode_batch on pre-decoded tensors, batched like the cache batches them; plus
    the scan and single-threaded decode times."""
    start = time.perf_counter()
    items = scan_dataset(load_dataset_config(toml), plugin.spec).items
    scanned = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a DataLoader worker
    decoded = [load_media(item, plugin.spec) for item in items]
    done = time.perf_counter()
    torch.set_num_threads(threads)
    encoders = plugin.require("load_encoders", model_config=config, device=torch.device("cpu"))
    work = [MediaWork("", item) for item in items]
    batches = [torch.stack([decoded[i].pixels for i in b]) for b in media_batches(work, batch_size)]
    captions = sorted({item.caption for item in items})
    t0 = time.perf_counter()
    for pixels in batches:
        plugin.require("encode_batch", encoders=encoders, batch=EncodeBatch(pixels=pixels))
    for s in range(0, len(captions), batch_size):
        plugin.require("encode_batch", encoders=encoders, batch=EncodeBatch(captions=captions[s : s + batch_size]))
    return time.perf_counter() - t0, len(items), scanned - start, done - scanned


def prepare_workers() -> int:
    from diffpipe_core.data.cache import _workers

    return _workers(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=None, help="decode workers (default: prepare_cache's)")
    parser.add_argument("--encoder-ms", type=float, default=0.0, help="simulated device time per media sample")
    parser.add_argument(
        "--vae",
        choices=["reference", "diffusers"],
        default="diffusers",
        help="'diffusers': a tiny real AutoencoderKL (default); 'reference': the pooling stand-in",
    )
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="diffpipe-bench-"))
    try:
        write_image_dataset(tmp / "data", args.images, size=(args.size, args.size))
        toml = write_dataset_toml(tmp / "dataset.toml", tmp / "data", resolutions=[args.size])
        registry = Registry()
        registry.register_model("reference", reference_plugin)
        if args.vae == "diffusers":
            registry.register_generic("diffusers_vae", DiffusersVAE())
        if args.encoder_ms:
            registry.register_generic("device_wait", DeviceWait(args.encoder_ms))
        plugin = registry.model("reference")
        config = plugin.spec.config_schema(type="reference", path=write_tiny_model(tmp / "model"))

        # Warm-up on a separate small dataset: one-time per-process costs (lazy torch imports, first
        # DataLoader start) are paid once per run, not per item, and would otherwise land on one side.
        write_image_dataset(tmp / "warm", 8, size=(args.size, args.size), seed=1)
        warm = write_dataset_toml(tmp / "warm.toml", tmp / "warm", resolutions=[args.size])
        prepare_cache(warm, plugin, config, batch_size=args.batch_size, decode_workers=args.workers, progress=False)

        alone, n, scan_s, decode_s = encoders_alone(plugin, config, toml, args.batch_size)
        t0 = time.perf_counter()
        ds = prepare_cache(
            toml, plugin, config, batch_size=args.batch_size, decode_workers=args.workers, progress=False
        )
        full = time.perf_counter() - t0
        assert ds.summary["encoded_media"] == n
        t0 = time.perf_counter()
        prepare_cache(toml, plugin, config, batch_size=args.batch_size, progress=False)
        reuse = time.perf_counter() - t0
        print(
            f"{n} images {args.size}x{args.size}, batch {args.batch_size}, {os.cpu_count()} CPUs, "
            f"VAE: {args.vae}, simulated encoder wait {args.encoder_ms:g} ms/sample"
        )
        print(
            f"for context: scan {scan_s:.3f} s, decode+resize in one thread {decode_s:.3f} s "
            f"({prepare_workers()} decode worker(s) by default)"
        )
        print(f"prepare_cache (fresh):        {full:7.3f} s  ({n / full:7.1f} items/s)")
        print(f"encode_batch alone:           {alone:7.3f} s  ({n / alone:7.1f} items/s)")
        print(f"framework share (full/alone): {full / alone:7.2f}x  (target <= 1.25)")
        print(f"prepare_cache (all reused):   {reuse:7.3f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
