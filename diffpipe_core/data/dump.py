"""``diffpipe data --dump DIR``: what the model will see, before any GPU time is spent.

Every item is decoded exactly as caching decodes it (:func:`diffpipe_core.data.decode.load_media`: its bucket's
crop and resize) and written as one PNG, ``items/<bucket>/<n>-<item id>.png``, with its other inputs beside it, left
to right: the image (a clip's first and last frame), its loss mask (white = trained), its control images. Each
bucket gets a contact sheet, ``sheets/<bucket>.png``: a line with its counts over the grid of its items (the
sampling contact sheet's, :func:`diffpipe_core.sampling.contact_sheet.contact_sheet`), each captioned.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from diffpipe_core.atomic import atomic_write_bytes
from diffpipe_core.data.decode import MediaError, load_media
from diffpipe_core.data.items import Bucket, MediaItem, ScanResult
from diffpipe_core.types import ModelSpec

HEADER = 24
"""Pixels of the counts line above a bucket's contact sheet."""


@dataclass
class DumpSummary:
    """What :func:`dump_dataset` wrote: item images, one sheet per bucket, and the items that failed to decode."""

    items: int = 0
    sheets: list[Path] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)


def check_dump_dir(out: Path) -> str | None:
    """Why ``out`` cannot take a dump (a file, or a folder that is not empty), or None."""
    if out.exists() and not out.is_dir():
        return f"--dump {out}: is a file; give a new or empty folder"
    if out.is_dir() and any(out.iterdir()):
        return f"--dump {out}: is not empty; give a new or empty folder (a dump never mixes with older files)"
    return None


def item_panels(item: MediaItem, spec: ModelSpec) -> list[np.ndarray]:
    """The item's inputs as trained, uint8 ``(H, W, 3)``, left to right: its image (a clip: first and last frame),
    its mask, its control images. Raises :class:`MediaError` for a file that cannot be decoded."""
    from diffpipe_core.data.cache_encode import control_work
    from diffpipe_core.sampling.output import to_uint8

    media = load_media(item, spec)
    pixels = to_uint8(media.pixels)
    panels = [pixels] if pixels.ndim == 3 else [pixels[0], pixels[-1]]
    if media.mask is not None:
        panels.append(to_uint8(media.mask.expand(3, -1, -1) * 2 - 1))
    for k in range(len(item.controls)):
        control = to_uint8(load_media(control_work("", item, k).item, spec).pixels)
        panels.append(control if control.ndim == 3 else control[0])
    return panels


def side_by_side(panels: list[np.ndarray]) -> np.ndarray:
    """The panels in a row, top-aligned on black."""
    height = max(p.shape[0] for p in panels)
    return np.concatenate([np.pad(p, ((0, height - p.shape[0]), (0, 0), (0, 0))) for p in panels], axis=1)


def bucket_sheet(bucket: Bucket, images: list[np.ndarray], captions: list[str], samples: int) -> np.ndarray:
    """A bucket's contact sheet under a line naming its size and counts."""
    from PIL import Image, ImageDraw

    from diffpipe_core.sampling.contact_sheet import contact_sheet

    grid = contact_sheet(images, captions)
    sheet = Image.new("RGB", (grid.shape[1], grid.shape[0] + HEADER), "white")
    sheet.paste(Image.fromarray(grid), (0, HEADER))
    frames = f"{bucket.frames} frames" if bucket.frames > 1 else "image"
    text = f"{bucket.width}x{bucket.height} {frames}: {len(images)} items, {samples} samples per epoch"
    ImageDraw.Draw(sheet).text((8, 6), text, fill="black")
    return np.asarray(sheet)


def _name(n: int, item: MediaItem) -> str:
    return f"{n:05d}-{re.sub(r'[^A-Za-z0-9._#@-]+', '_', item.id)[-120:]}.png"


def dump_dataset(scan: ScanResult, spec: ModelSpec, out: Path, progress: bool = True) -> DumpSummary:
    """Write every item of ``scan`` as it will be trained, and one contact sheet per bucket, under ``out`` (see the
    module's docstring). An item that fails to decode is listed in the summary, not written."""
    from diffpipe_core.sampling.output import png_bytes

    summary = DumpSummary()
    shown: dict[Bucket, list[np.ndarray]] = defaultdict(list)
    captions: dict[Bucket, list[str]] = defaultdict(list)
    samples: dict[Bucket, int] = defaultdict(int)
    for n, item in enumerate(tqdm(scan.items, desc="dumping items", unit="item", disable=not progress)):
        samples[item.bucket] += item.repeats
        try:
            panels = item_panels(item, spec)
        except MediaError as exc:
            summary.failed.append((item.id, str(exc)))
            continue
        atomic_write_bytes(out / "items" / str(item.bucket) / _name(n, item), png_bytes(side_by_side(panels)))
        shown[item.bucket].append(panels[0])
        captions[item.bucket].append(f"{item.id}: {item.caption}")
        summary.items += 1
    for bucket in sorted(shown):
        path = out / "sheets" / f"{bucket}.png"
        atomic_write_bytes(path, png_bytes(bucket_sheet(bucket, shown[bucket], captions[bucket], samples[bucket])))
        summary.sheets.append(path)
    return summary
