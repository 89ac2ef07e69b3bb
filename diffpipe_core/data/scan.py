"""Discover the dataset: media files, their captions and masks, probed sizes, buckets and clips.

Every file that is left out becomes a :class:`SkippedFile` whose reason starts with a short category
(``"unreadable: ..."``, ``"too short: ..."``); :func:`reason_category` extracts it for summaries.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm.auto import tqdm

from diffpipe_core.data.buckets import (
    clip_starts,
    closest_bucket,
    frame_bucket_problems,
    resampled_frame_count,
    spatial_buckets,
    video_frame_bucket,
)
from diffpipe_core.data.cache_keys import file_content_key
from diffpipe_core.data.dataset_config import DatasetConfig, DirectorySettings
from diffpipe_core.data.decode import MediaError, probe_image, probe_video
from diffpipe_core.data.items import Bucket, MediaItem, ScanResult, SkippedFile
from diffpipe_core.schema import ConfigError
from diffpipe_core.types import ModelSpec

log = logging.getLogger("diffpipe.data")

IMAGE_EXTS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"})
VIDEO_EXTS = frozenset({".mp4", ".mov", ".webm", ".mkv", ".avi"})
# Files that live beside media and are not candidates themselves: ignored without a note.
SIDECAR_EXTS = frozenset({".txt", ".json", ".caption", ".npz", ".safetensors", ".toml", ".md"})
CAPTIONS_JSON = "captions.json"

# What each skip category means and how to fix it, for the empty-dataset error.
CATEGORY_HINTS = {
    "no caption": "add name.txt beside each file or a captions.json, or set allow_empty_captions = true",
    "aspect ratio": "widen min_ar/max_ar (or ar_buckets)",
    "too short": "add a smaller frame bucket to frame_buckets",
    "video": "use a video model, or remove the videos",
}


class DatasetError(Exception):
    """The dataset cannot be used as a whole (for example, nothing is left after filtering)."""


def reason_category(reason: str) -> str:
    """The short category a skip reason starts with (``"unreadable"`` for ``"unreadable: ..."``)."""
    return reason.split(":", 1)[0].strip()


# ---------------------------------------------------------------------------------------------- captions


class _CaptionError(Exception):
    pass


_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


def read_caption(path: Path) -> str:
    """A caption file's text: UTF-8, or UTF-8/16/32 with a byte-order mark. Other encodings raise
    ``ValueError`` saying where the first bad byte is, rather than guessing and training on mojibake."""
    data = path.read_bytes()
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                return data.decode(encoding).strip()
            except UnicodeDecodeError:
                break
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"caption file {path.name} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}); save it as UTF-8"
        ) from None


class _Captions:
    """Finds the caption of a media file: ``name.txt`` beside it, else a ``captions.json`` in its folder
    (keyed by file name) or in the directory root (keyed by relative path)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._json: dict[Path, dict[str, str]] = {}

    def _load_json(self, folder: Path) -> dict[str, str]:
        if folder not in self._json:
            table: dict[str, str] = {}
            path = folder / CAPTIONS_JSON
            if path.is_file():
                try:
                    raw = json.loads(read_caption(path))
                    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
                        raise ValueError('expected an object {"file name": "caption", ...}')
                    table = {str(k): v.strip() for k, v in raw.items()}
                except ValueError as exc:
                    log.warning("ignoring %s: %s", path, exc)
            self._json[folder] = table
        return self._json[folder]

    def find(self, media: Path) -> tuple[str | None, str]:
        """(caption or None, where it was looked for). Raises _CaptionError for an unreadable file."""
        txt = media.with_suffix(".txt")
        if txt.is_file():
            try:
                return read_caption(txt), str(txt.name)
            except (ValueError, OSError) as exc:
                raise _CaptionError(str(exc)) from None
        local = self._load_json(media.parent)
        if media.name in local:
            return local[media.name], CAPTIONS_JSON
        rel = media.relative_to(self.root).as_posix()
        if media.parent != self.root and rel in self._load_json(self.root):
            return self._json[self.root][rel], CAPTIONS_JSON
        return None, f"{txt.name} or an entry in {CAPTIONS_JSON}"


def shuffled_variants(
    caption: str, prefix: str, settings: DirectorySettings, seed_text: str
) -> tuple[str, ...]:
    """``cache_shuffle_num`` tag orders of ``caption`` (prefix kept first), deterministic per item so that
    a re-scan yields the same texts and the text-embedding cache stays valid."""
    tags = [t.strip() for t in caption.split(settings.tag_delimiter.strip() or settings.tag_delimiter)]
    tags = [t for t in tags if t]
    if len(tags) < 2:
        return ()
    rng = random.Random(hashlib.sha256(seed_text.encode()).digest())
    variants = []
    for _ in range(settings.cache_shuffle_num):
        order = tags[:]
        rng.shuffle(order)
        variants.append(prefix + settings.tag_delimiter.join(order))
    return tuple(variants)


# ---------------------------------------------------------------------------------------------- discovery


def _walk(root: Path, exclude: set[Path]) -> list[Path]:
    """Every non-hidden file under ``root``, sorted, skipping excluded folders (masks, cache, other
    [[directory]] roots)."""
    found = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and (here / d).resolve() not in exclude)
        found.extend(here / f for f in sorted(files) if not f.startswith("."))
    return found


def _find_mask(mask_root: Path, rel: Path) -> Path | None:
    folder = mask_root / rel.parent
    for ext in sorted(IMAGE_EXTS):
        for candidate in (folder / (rel.stem + ext), folder / (rel.stem + ext.upper())):
            if candidate.is_file():
                return candidate
    return None


class _Skip(Exception):
    pass


def _without_path(exc: Exception, path: Path) -> str:
    """A probe error's message without the leading file name (the report shows it in its own column)."""
    text = str(exc)
    return text[len(str(path)) + 2 :] if text.startswith(f"{path}: ") else text


def _scan_file(
    path: Path,
    settings: DirectorySettings,
    spec: ModelSpec,
    strict: bool,
    captions: _Captions,
    id_base: str,
) -> list[MediaItem]:
    """The items of one file, or raise _Skip(reason)."""
    ext = path.suffix.lower()
    is_video = ext in VIDEO_EXTS
    if ext not in IMAGE_EXTS and not is_video:
        raise _Skip(
            f"not media: unsupported extension {path.suffix!r} (images: {', '.join(sorted(IMAGE_EXTS))}; "
            f"videos: {', '.join(sorted(VIDEO_EXTS))})"
        )
    if is_video and spec.modality != "video":
        raise _Skip(f"video: model {spec.name!r} trains on images only")
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise _Skip(f"unreadable: {exc}") from None
    if size == 0:
        raise _Skip("empty file: 0 bytes")

    try:
        if is_video:
            info = probe_video(path)
            width, height = info.width, info.height
        else:
            width, height = probe_image(path)
    except MediaError as exc:
        kind = getattr(exc, "kind", "unreadable")
        raise _Skip(f"{kind}: {_without_path(exc, path)}") from None

    try:
        caption, looked = captions.find(path)
    except _CaptionError as exc:
        raise _Skip(f"caption encoding: {exc}") from None
    if not caption and not settings.allow_empty_captions:
        what = "empty caption" if caption is not None else f"no {looked}"
        raise _Skip(f"no caption: {what}, and allow_empty_captions is false")
    body = caption or ""

    if settings.enable_ar_bucket:
        ar = width / height
        if not (settings.min_ar * (1 - 1e-6) <= ar <= settings.max_ar * (1 + 1e-6)):
            raise _Skip(
                f"aspect ratio: {width}x{height} (width/height {ar:.3f}) is outside min_ar..max_ar = "
                f"{settings.min_ar:g}..{settings.max_ar:g}"
            )

    mask = None
    if settings.mask_path is not None:
        mask = _find_mask(settings.mask_path, path.relative_to(settings.path))
        if mask is not None:
            try:
                mw, mh = probe_image(mask)
            except MediaError as exc:
                raise _Skip(f"unreadable mask: {exc}") from None  # names the mask file
            if (mw, mh) != (width, height):
                raise _Skip(f"mask size: mask {mask} is {mw}x{mh} but the media is {width}x{height}")

    frames = 1
    starts: list[float | None] = [None]
    if is_video:
        fps = float(spec.video_fps) if spec.video_fps else info.fps
        available = resampled_frame_count(info.duration, fps)
        chosen = video_frame_bucket(available, settings.frame_buckets)
        if chosen is None:
            video_buckets = [f for f in settings.frame_buckets if f > 1]
            if not video_buckets:
                raise _Skip("too short: frame_buckets has no count above 1, so no video fits; add e.g. 33")
            raise _Skip(
                f"too short: {available} frames at {fps:g} fps ({info.duration:.2f}s); the smallest frame "
                f"bucket is {min(video_buckets)}"
            )
        frames = chosen
        starts = [s / fps for s in clip_starts(available, chosen, settings.video_clip_mode)]

    key = file_content_key(path, strict)
    if mask is not None:
        key += "|mask:" + file_content_key(mask, strict)
    prefix = settings.caption_prefix
    full_caption = prefix + body
    variants = (
        shuffled_variants(body, prefix, settings, id_base + "\0" + body) if settings.shuffle_tags else ()
    )

    items = []
    multi_res = len(settings.resolutions) > 1
    seen: set[Bucket] = set()
    for res in settings.resolutions:
        spatial = closest_bucket(width, height, spatial_buckets(res, settings, spec.spatial_multiple))
        bucket = Bucket(spatial.width, spatial.height, frames)
        if bucket in seen:  # two resolutions that round to the same size
            continue
        seen.add(bucket)
        for k, start in enumerate(starts):
            item_id = (
                id_base
                + (f"#{k}" if len(starts) > 1 else "")
                + (f"@{spatial.width}x{spatial.height}" if multi_res else "")
            )
            items.append(
                MediaItem(
                    id=item_id,
                    path=path,
                    caption=full_caption,
                    bucket=bucket,
                    content_key=key,
                    mask_path=mask,
                    clip_start=start,
                    repeats=settings.num_repeats,
                    directory=settings.index,
                    caption_variants=variants,
                )
            )
    return items


def _id_base(path: Path, settings: DirectorySettings, anchor: Path | None) -> str:
    for base in (anchor, settings.path):
        if base is not None:
            try:
                return path.relative_to(base).as_posix()
            except ValueError:
                continue
    return path.as_posix()


def scan_dataset(cfg: DatasetConfig, spec: ModelSpec, strict: bool = False) -> ScanResult:
    """Find every usable item of the dataset for model ``spec``; list every file left out, with why.

    ``strict`` keys media content by a SHA-256 of the bytes instead of size+mtime. Raises
    :class:`DatasetError` when nothing is left, saying which filter removed how many files, and
    ``ConfigError`` when frame_buckets do not fit the model.
    """
    settings = [cfg.settings_for(i) for i in range(len(cfg.directory))]
    if spec.modality == "video":
        problems = []
        for s in settings:
            where = "" if cfg.directory[s.index].frame_buckets is None else f"directory[{s.index}]."
            problems += frame_bucket_problems(s.frame_buckets, spec, f"{cfg.source or 'dataset'}: {where}")
        if problems:
            raise ConfigError(sorted(set(problems)))

    anchor = cfg.source.parent if cfg.source is not None else None
    roots = {s.path.resolve() for s in settings}
    excluded = {s.mask_path.resolve() for s in settings if s.mask_path is not None}
    if cfg.cache_dir is not None:
        excluded.add(cfg.cache_dir.resolve())

    jobs = []
    for s in settings:
        captions = _Captions(s.path)
        exclude = excluded | (roots - {s.path.resolve()})
        for path in _walk(s.path, exclude):
            if path.name == CAPTIONS_JSON or path.suffix.lower() in SIDECAR_EXTS:
                continue
            jobs.append((path, s, captions))

    result = ScanResult()
    seen_ids: set[str] = set()

    def run(job: tuple[Path, DirectorySettings, _Captions]) -> list[MediaItem] | SkippedFile:
        path, s, captions = job
        try:
            return _scan_file(path, s, spec, strict, captions, _id_base(path, s, anchor))
        except _Skip as exc:
            return SkippedFile(path, str(exc))
        except Exception as exc:  # anything unexpected still leaves the run going, named
            return SkippedFile(path, f"unreadable: {type(exc).__name__}: {exc}")

    workers = min(8, (os.cpu_count() or 2) * 2)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        outcomes = pool.map(run, jobs)
        for (_path, s, _), outcome in tqdm(
            zip(jobs, outcomes),
            total=len(jobs),
            desc="scanning dataset",
            unit="file",
            leave=False,
            disable=len(jobs) < 200,
        ):
            if isinstance(outcome, SkippedFile):
                result.skipped.append(outcome)
                log.warning("left out %s: %s", outcome.path, outcome.reason)
                continue
            for item in outcome:
                if item.id in seen_ids:  # the same file listed by two [[directory]] entries
                    item = _with_id(item, f"{item.id}@dir{s.index}")
                seen_ids.add(item.id)
                result.items.append(item)

    counts = Counter(reason_category(s.reason) for s in result.skipped)
    summary = f"dataset: {len(result.items)} items from {len(jobs) - len(result.skipped)} files"
    if result.skipped:
        summary += "; left out " + ", ".join(f"{n} {cat}" for cat, n in counts.most_common())
    log.info(summary)
    if not result.items:
        raise DatasetError(_empty_message(cfg, settings, jobs, counts))
    return result


def _with_id(item: MediaItem, new_id: str) -> MediaItem:
    from dataclasses import replace

    return replace(item, id=new_id)


def _empty_message(cfg: DatasetConfig, settings: list[DirectorySettings], jobs: list, counts: Counter) -> str:
    dirs = ", ".join(str(s.path) for s in settings)
    if not jobs:
        exts = ", ".join(sorted(IMAGE_EXTS | VIDEO_EXTS))
        return f"the dataset is empty: no files found in {dirs} (looked for {exts})"
    lines = [f"the dataset is empty: all {len(jobs)} files in {dirs} were left out:"]
    for category, n in counts.most_common():
        hint = CATEGORY_HINTS.get(category)
        lines.append(f"  {n} x {category}" + (f" ({hint})" if hint else ""))
    lines.append("run `diffpipe data` to list every file and its reason")
    return "\n".join(lines)
