"""Is the cache's item list still the one this scan would make? One hash of the plan answers it.

Every cache key is a function of the scan's items (file, content key, bucket, clip, mask, repeats, caption
texts, control images), of the encoder fingerprint (plugin, version, encoder settings and the encoder files'
identity) and of ``strict``. :func:`plan_digest` hashes exactly those inputs. ``prepare_cache`` stores it in the cache
index; when a later start computes the same digest and the index has the same fingerprint, the stored
entries are the ones it would compute, so the cache opens without hashing 100,000 keys or listing every
shard twice. The scan itself (with its index, one ``stat`` a file) is what checks that no media file or
caption changed; the fingerprint, that no encoder did.
"""

from __future__ import annotations

import hashlib
from typing import Any

from diffpipe_core.data.items import ScanResult


def plan_digest(scan: ScanResult, *inputs: Any) -> str:
    """SHA-256 over every item's identity and cache inputs, every skipped file with its reason, and
    ``inputs`` (the encoder fingerprint, ``strict``, the empty-prompt key...)."""
    h = hashlib.sha256(repr(inputs).encode())
    for item in scan.items:
        b = item.bucket
        variants = "\1".join(item.caption_variants or (item.caption,))
        h.update(
            f"{item.id}\0{item.path}\0{item.content_key}\0{b.width},{b.height},{b.frames}\0{item.clip_start}\0"
            f"{item.mask_path}\0{item.repeats}\0{item.directory}\0{variants}\n".encode("utf-8", "surrogatepass")
        )
        for c in item.controls:  # edit pairs: a changed control image changes the plan
            h.update(f"\3{c.path}\0{c.content_key}\0{c.bucket.width},{c.bucket.height}\n".encode(
                "utf-8", "surrogatepass"))
        for f in (*item.paired, *(f for c in item.controls for f in c.paired)):  # paired files likewise
            h.update(f"\4{f.role}\0{f.path}\0{f.content_key}\n".encode("utf-8", "surrogatepass"))
    h.update(b"\2skipped\n")
    for s in scan.skipped:
        h.update(f"{s.path}\0{s.reason}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()
