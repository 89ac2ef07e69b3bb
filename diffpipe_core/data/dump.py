"""``diffpipe data --dump DIR``: what the model will see, before any GPU time is spent.

Every item is decoded exactly as caching decodes it (:func:`diffpipe_core.data.decode.load_media`: its bucket's
crop and resize) and written as one PNG, ``items/<bucket>/<n>-<item id>.png``, with its other inputs beside it, left
to right: the image (a clip's first and last frame), its loss mask (white = trained), its control images. Each
bucket gets a contact sheet, ``sheets/<bucket>.png``: a header with its counts over a grid of its items' thumbnails.
"""

from __future__ import annotations

import io
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image, ImageDraw
from tqdm.auto import tqdm

from diffpipe_core.atomic import atomic_write_bytes
from diffpipe_core.data.decode import MediaError, load_media
from diffpipe_core.data.items import Bucket, MediaItem, ScanResult
from diffpipe_core.types import ModelSpec

if TYPE_CHECKING:
    import torch

SHEET_COLUMNS = 8
THUMB = 128  # the longest side of a thumbnail on a contact sheet, in pixels
HEADER = 24  # the height of a contact sheet's header line


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


def _image(pixels: torch.Tensor) -> Image.Image:
    """A ``(3, H, W)`` tensor in [-1, 1] as an RGB image."""
    import numpy as np
    import torch

    arr = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return Image.fromarray(np.ascontiguousarray(arr.permute(1, 2, 0).numpy()), "RGB")


def _mask_image(mask: torch.Tensor) -> Image.Image:
    return _image(mask.expand(3, -1, -1) * 2 - 1)


def item_panels(item: MediaItem, spec: ModelSpec) -> list[Image.Image]:
    """The item's inputs as trained, left to right: its image (a clip: first and last frame), its mask, its
    control images. Raises :class:`MediaError` for a file that cannot be decoded."""
    from diffpipe_core.data.cache_encode import control_work

    media = load_media(item, spec)
    pixels = media.pixels
    panels = [_image(pixels)] if pixels.dim() == 3 else [_image(pixels[:, 0]), _image(pixels[:, -1])]
    if media.mask is not None:
        panels.append(_mask_image(media.mask))
    for k in range(len(item.controls)):
        control = load_media(control_work("", item, k).item, spec)
        panels.append(_image(control.pixels if control.pixels.dim() == 3 else control.pixels[:, 0]))
    return panels


def side_by_side(panels: list[Image.Image]) -> Image.Image:
    """The panels in a row, top-aligned on black."""
    canvas = Image.new("RGB", (sum(p.width for p in panels), max(p.height for p in panels)))
    x = 0
    for p in panels:
        canvas.paste(p, (x, 0))
        x += p.width
    return canvas


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def _name(n: int, item: MediaItem) -> str:
    return f"{n:05d}-{re.sub(r'[^A-Za-z0-9._#@-]+', '_', item.id)[-120:]}.png"


def thumb_size(bucket: Bucket) -> tuple[int, int]:
    """A bucket's thumbnail size on its contact sheet: its aspect ratio, the longest side :data:`THUMB`."""
    scale = THUMB / max(bucket.width, bucket.height)
    return max(1, round(bucket.width * scale)), max(1, round(bucket.height * scale))


def contact_sheet(bucket: Bucket, thumbs: list[Image.Image], samples: int) -> Image.Image:
    """A bucket's sheet: a header naming its size and counts over its thumbnails, :data:`SHEET_COLUMNS` a row."""
    tw, th = thumb_size(bucket)
    columns = min(SHEET_COLUMNS, max(1, len(thumbs)))
    rows = -(-len(thumbs) // columns)
    sheet = Image.new("RGB", (max(columns * tw, 320), HEADER + rows * th), "white")
    frames = f"{bucket.frames} frames" if bucket.frames > 1 else "image"
    text = f"{bucket.width}x{bucket.height} {frames}: {len(thumbs)} items, {samples} samples per epoch"
    ImageDraw.Draw(sheet).text((4, 6), text, fill="black")
    for i, thumb in enumerate(thumbs):
        sheet.paste(thumb, ((i % columns) * tw, HEADER + (i // columns) * th))
    return sheet


def dump_dataset(scan: ScanResult, spec: ModelSpec, out: Path, progress: bool = True) -> DumpSummary:
    """Write every item of ``scan`` as it will be trained, and one contact sheet per bucket, under ``out`` (see the
    module's docstring). An item that fails to decode is listed in the summary, not written."""
    summary = DumpSummary()
    thumbs: dict[Bucket, list[Image.Image]] = defaultdict(list)
    samples: dict[Bucket, int] = defaultdict(int)
    for n, item in enumerate(tqdm(scan.items, desc="dumping items", unit="item", disable=not progress)):
        samples[item.bucket] += item.repeats
        try:
            panels = item_panels(item, spec)
        except MediaError as exc:
            summary.failed.append((item.id, str(exc)))
            continue
        atomic_write_bytes(out / "items" / str(item.bucket) / _name(n, item), _png(side_by_side(panels)))
        thumbs[item.bucket].append(panels[0].resize(thumb_size(item.bucket), Image.Resampling.LANCZOS))
        summary.items += 1
    for bucket in sorted(thumbs):
        path = out / "sheets" / f"{bucket}.png"
        atomic_write_bytes(path, _png(contact_sheet(bucket, thumbs[bucket], samples[bucket])))
        summary.sheets.append(path)
    return summary
