"""The data pipeline: dataset TOML -> scan and bucket -> decode -> cached latents and text embeddings
(HF datasets on local disk) -> bucket-homogeneous, data-parallel micro-batches.

The names below are imported on first use, so importing a light submodule (``data.items``) does not
pull in HF datasets.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "prepare_cache": "diffpipe_core.data.cache",
    "CachedDataset": "diffpipe_core.data.cache",
    "CacheError": "diffpipe_core.data.cache",
    "BucketSampler": "diffpipe_core.data.sampler",
    "Bucket": "diffpipe_core.data.items",
    "DecodedMedia": "diffpipe_core.data.items",
    "MediaItem": "diffpipe_core.data.items",
    "ScanResult": "diffpipe_core.data.items",
    "SkippedFile": "diffpipe_core.data.items",
}

__all__ = [
    "Bucket",
    "BucketSampler",
    "CacheError",
    "CachedDataset",
    "DecodedMedia",
    "MediaItem",
    "ScanResult",
    "SkippedFile",
    "prepare_cache",
]

if TYPE_CHECKING:
    from diffpipe_core.data.cache import CachedDataset, CacheError, prepare_cache
    from diffpipe_core.data.items import Bucket, DecodedMedia, MediaItem, ScanResult, SkippedFile
    from diffpipe_core.data.sampler import BucketSampler


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'diffpipe_core.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
