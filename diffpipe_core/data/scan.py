"""Discover the dataset: media files, their captions and masks, probed sizes, buckets and clips.

Every file that is left out becomes a :class:`SkippedFile` whose reason starts with a short category
(``"unreadable: ..."``, ``"too short: ..."``); :func:`reason_category` extracts it for summaries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import tarfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from diffpipe_core.data import archives, captions
from diffpipe_core.data.archives import TAR_EXT, beside_archive
from diffpipe_core.data.buckets import (
    clip_starts,
    closest_bucket,
    closest_size_bucket,
    frame_bucket_problems,
    resampled_frame_count,
    spatial_buckets,
    video_frame_bucket,
)
from diffpipe_core.data.controls import (
    PAIRED_WHAT,
    ControlFolder,
    control_folders,
    first_frame_problems,
    no_pair_problems,
    paired_folders,
    paired_problems,
    paired_spec_problems,
    spec_problems,
    target_stem,
    unpaired_video_problems,
)
from diffpipe_core.data.dataset_config import DatasetConfig, DirectorySettings
from diffpipe_core.data.decode import MediaError, VideoInfo
from diffpipe_core.data.items import Bucket, ControlImage, MediaItem, PairedFile, ScanResult, SkippedFile
from diffpipe_core.data.scan_index import IMAGE, TEXT, VIDEO, ScanIndex, gc_paused, index_path
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
    "aspect ratio": "widen min_ar/max_ar (or ar_buckets), or set drop_outside_ar = false to crop them",
    "too short": "add a smaller frame bucket to frame_buckets",
    "video": "use a video model, or remove the videos",
    "no control image": "put each target's control image in the control folder under the same relative path and "
    "stem (a/b.png <-> a/b.jpg)",
    "unreadable control": "replace the damaged control images",
    "size buckets": "add a [width, height, 1] size to size_buckets for the images",
    "too small": "use larger media, a smaller resolution, or raise max_upscale",
    "too cropped": "turn on enable_ar_bucket (with a wider min_ar..max_ar), or raise max_crop",
}


class DatasetError(Exception):
    """The dataset cannot be used as a whole (for example, nothing is left after filtering).

    ``result`` is the scan (every file left out, with why) and ``summary`` the message without the closing
    pointer to ``diffpipe data``, for that command itself."""

    def __init__(self, summary: str, result: ScanResult | None = None, hint: str = "") -> None:
        super().__init__(summary + (f"\n{hint}" if hint else ""))
        self.summary, self.result = summary, result


def reason_category(reason: str) -> str:
    """The short category a skip reason starts with (``"unreadable"`` for ``"unreadable: ..."``)."""
    return reason.split(":", 1)[0].strip()


# ---------------------------------------------------------------------------------------------- captions


class _CaptionError(Exception):
    pass


def _json_captions(value: object) -> tuple[str, ...] | None:
    """A captions.json entry as its captions: a string is one caption, a list of strings several (diffusion-pipe's
    form); None for anything else."""
    if isinstance(value, str):
        return (value.strip(),)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(t for t in (v.strip() for v in value) if t)
    return None


class _Captions:
    """Finds the captions of a media file: ``name.txt`` beside it, else a ``captions.json`` in its folder
    (keyed by file name) or in the directory root (keyed by relative path; a ``.tar`` archive's members by their
    name in it, as diffusion-pipe keys them). An entry is a caption or a list of captions."""

    def __init__(self, root: Path, index: ScanIndex) -> None:
        self.root = root
        self.index = index
        self._json: dict[Path, dict[str, tuple[str, ...]]] = {}

    def _load_json(self, folder: Path) -> dict[str, tuple[str, ...]]:
        if folder not in self._json:
            table: dict[str, tuple[str, ...]] = {}
            path = folder / CAPTIONS_JSON
            if path.is_file():
                try:
                    raw = json.loads(captions.read_caption(path))
                    if not isinstance(raw, dict):
                        raise ValueError('expected an object {"file name": "caption" or ["caption", ...], ...}')
                    for k, v in raw.items():
                        texts = _json_captions(v)
                        if texts is None:
                            raise ValueError(f"entry {k!r}: expected a caption or a list of captions, got "
                                             f"{type(v).__name__}")
                        table[str(k)] = texts
                except ValueError as exc:
                    log.warning("ignoring %s: %s", path, exc)
            self._json[folder] = table
        return self._json[folder]

    def find(self, media: Path, txt: str | None = None) -> tuple[tuple[str, ...] | None, str]:
        """(the captions, or None; where they were looked for); ``txt`` is ``media.with_suffix(".txt")`` as a
        string. Raises _CaptionError for an unreadable file."""
        txt = txt or str(media.with_suffix(".txt"))
        member = archives.split(media) if archives.TAR_SEP in txt else None  # txt: the media's path as a string
        if member is None:
            try:
                text = self.index.caption(txt)  # read only if new or changed since the last scan
            except (ValueError, OSError) as exc:
                raise _CaptionError(str(exc)) from None
            if text is not None:
                return (text,), txt
            folder, name = media.parent, media.name
        else:
            try:
                text = archives.member_text(media)
            except (ValueError, OSError) as exc:
                raise _CaptionError(str(exc)) from None
            if text is not None:
                return (text,), f"{member[0].name}/{Path(member[1]).with_suffix('.txt')}"
            folder, name = member[0].parent, member[1]
        local = self._load_json(folder)
        if name in local:
            return local[name], CAPTIONS_JSON
        rel = (folder / name).relative_to(self.root).as_posix()
        if folder != self.root and rel in self._load_json(self.root):
            return self._json[self.root][rel], CAPTIONS_JSON
        return None, (f"{Path(name).stem}.txt in {member[0].name} or an entry {name!r} in {CAPTIONS_JSON}"
                      if member else f"{os.path.basename(txt)} or an entry in {CAPTIONS_JSON}")


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


def _caption_variants(texts: tuple[str, ...], prefix: str, settings: DirectorySettings, id_base: str
                      ) -> tuple[str, ...]:
    """The caption texts cached for an item (one is drawn per epoch): its shuffled tag orders (shuffle_tags), or
    its several captions (a captions.json list), each after the prefix; () for one caption as it is."""
    if settings.shuffle_tags:
        variants: list[str] = []
        for text in texts:
            variants += shuffled_variants(text, prefix, settings, id_base + "\0" + text) or (prefix + text,)
        return tuple(variants) if len(variants) > 1 else ()
    return tuple(prefix + t for t in texts) if len(texts) > 1 else ()


# ---------------------------------------------------------------------------------------------- discovery


def _walk(root: Path, exclude: set[Path]) -> list[tuple[Path, list[str]]]:
    """Every folder under ``root`` with its non-hidden file names, sorted, skipping excluded folders (masks,
    cache, other [[directory]] roots). Names stay strings: a Path per file costs more than the scan index's
    ``stat`` of it."""
    found = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and (here / d).resolve() not in exclude)
        found.append((here, sorted(f for f in files if not f.startswith("."))))
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


class _Buckets:
    """``closest_bucket`` over ``spatial_buckets``, remembered per directory, resolution and size: a dataset has
    few distinct sizes, and computing the buckets anew for each of 100,000 files would dominate a re-scan."""

    def __init__(self, multiple: int) -> None:
        self.multiple = multiple
        self._memo: dict[tuple, Bucket] = {}

    def closest(self, width: int, height: int, settings: DirectorySettings, res: object) -> Bucket:
        key = (width, height, settings.index, tuple(res) if isinstance(res, list) else res)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = closest_bucket(width, height, spatial_buckets(res, settings, self.multiple))
        return found


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
    index: ScanIndex,
    key: str,
    ext: str,
    buckets: _Buckets,
    txt: str,
    controls: list[tuple[ControlFolder, str | None]],
    files: list[tuple[str, ControlFolder, str | None]] = (),  # type: ignore[assignment]
) -> list[MediaItem]:
    """The items of one file (``key``: its path as a string, ``ext``: its suffix, lower case), or raise
    _Skip(reason). ``controls``: each control folder of its directory with the file paired there (or None);
    ``files``: each paired-file folder's role, the folder and the file paired there (``ModelSpec.paired_files``)."""
    is_video = ext in VIDEO_EXTS
    if ext not in IMAGE_EXTS and not is_video:
        raise _Skip(
            f"not media: unsupported extension {path.suffix!r} (images: {', '.join(sorted(IMAGE_EXTS))}; "
            f"videos: {', '.join(sorted(VIDEO_EXTS))})"
        )
    if is_video and spec.modality != "video":
        raise _Skip(f"video: model {spec.name!r} trains on images only")
    try:
        size, facts = index.media(key, VIDEO if is_video else IMAGE)  # probed only if new or changed
    except OSError as exc:
        raise _Skip(f"unreadable: {exc}") from None
    except MediaError as exc:
        kind = getattr(exc, "kind", "unreadable")
        raise _Skip(f"{kind}: {_without_path(exc, path)}") from None
    if size == 0 or facts is None:
        raise _Skip("empty file: 0 bytes")
    if is_video:
        info = facts
        width, height = info.width, info.height
    else:
        width, height = facts

    try:
        texts, looked = captions.find(path, txt)
    except _CaptionError as exc:
        raise _Skip(f"caption encoding: {exc}") from None
    texts = tuple(t for t in texts if t) if texts is not None else None
    if not texts and not settings.allow_empty_captions:
        what = "empty caption" if texts is not None else f"no {looked}"
        raise _Skip(f"no caption: {what}, and allow_empty_captions is false")
    body = texts[0] if texts else ""

    if settings.enable_ar_bucket and settings.drop_outside_ar:  # else the nearest bucket takes it, cropped
        ar = width / height
        if not (settings.min_ar * (1 - 1e-6) <= ar <= settings.max_ar * (1 + 1e-6)):
            raise _Skip(
                f"aspect ratio: {width}x{height} (width/height {ar:.3f}) is outside min_ar..max_ar = "
                f"{settings.min_ar:g}..{settings.max_ar:g} and drop_outside_ar is true"
            )

    mask = None
    if settings.mask_path is not None:
        mask = _find_mask(settings.mask_path, beside_archive(path).relative_to(settings.path))
        if mask is not None:
            try:
                _, mask_size = index.media(mask, IMAGE)
            except (MediaError, OSError) as exc:
                raise _Skip(f"unreadable mask: {exc}") from None  # names the mask file
            if mask_size is None:
                raise _Skip(f"unreadable mask: {mask}: empty file (0 bytes)")
            mw, mh = mask_size
            if (mw, mh) != (width, height):
                raise _Skip(f"mask size: mask {mask} is {mw}x{mh} but the media is {width}x{height}")
    stretched = mask is None and settings.default_mask_file is not None
    if stretched:
        mask = settings.default_mask_file
        try:
            index.media(mask, IMAGE)  # read once per scan; a broken default mask leaves out every item of the folder
        except (MediaError, OSError) as exc:
            raise _Skip(f"unreadable mask: {exc}") from None

    paired = _paired_controls(path, settings, index, controls, spec.control_videos)
    extra = _paired_files(path, settings, index, files, paired)

    frames = 1
    starts: list[float | None] = [None]
    sized = None  # the size_buckets size of the item
    if settings.size_buckets and not is_video:
        sized = closest_size_bucket(width, height, 1, False, settings.size_buckets, buckets.multiple)
        if sized is None:
            raise _Skip("size buckets: size_buckets has no [width, height, 1] size for images")
    if is_video:
        fps = float(spec.video_fps) if spec.video_fps else info.fps
        available = resampled_frame_count(info.duration, fps)
        if settings.size_buckets:
            sized = closest_size_bucket(width, height, available, True, settings.size_buckets, buckets.multiple)
            chosen = sized.frames if sized is not None else None
        else:
            chosen = video_frame_bucket(available, settings.frame_buckets)
        if chosen is None:
            video_buckets = [f for f in settings.frame_buckets if f > 1]
            if not video_buckets:
                raise _Skip("too short: frame_buckets has no count above 1, so no video fits; add e.g. 33")
            images = " (frame bucket 1 is for images: save a single frame as an image to train on it)" if (
                1 in settings.frame_buckets) else ""
            raise _Skip(
                f"too short: {available} frame{'s' if available != 1 else ''} at {fps:g} fps "
                f"({info.duration:.2f}s); a video needs at least {min(video_buckets)} frames, the smallest "
                f"video frame bucket{images}"
            )
        frames = chosen
        starts = [s / fps for s in clip_starts(available, chosen, settings.video_clip_mode)]

    content = index.content_key(key)
    if mask is not None:
        content += "|mask:" + index.content_key(mask)
    prefix = settings.caption_prefix
    full_caption = prefix + body
    variants = _caption_variants(texts or (body,), prefix, settings, id_base)

    items = []
    resolutions = [None] if sized is not None else settings.resolutions
    multi_res = len(resolutions) > 1
    beyond: list[str] = []  # why a resolution's bucket would distort it too much
    seen: set[Bucket] = set()
    for res in resolutions:
        spatial = sized if sized is not None else buckets.closest(width, height, settings, res)
        bucket = Bucket(spatial.width, spatial.height, frames)
        # the share of the image the center crop to the bucket's aspect ratio cuts away
        crop = 1 - min(width * spatial.height, spatial.width * height) / max(width * spatial.height,
                                                                             spatial.width * height)
        if bucket in seen:  # two resolutions that round to the same size
            continue
        too_far = _too_far(width, height, spatial, crop, settings)
        if too_far:
            beyond.append(too_far)
            continue
        seen.add(bucket)
        item_controls = tuple(
            ControlImage(Path(c), _own_bucket(cw, ch, settings, res, buckets) if spec.control_size == "own"
                         else Bucket(spatial.width, spatial.height), ckey)
            for c, (cw, ch), ckey, _ in paired
        )
        for k, start in enumerate(starts):
            if spec.control_videos:  # each clip's control video: the same frames of the paired file
                item_controls = _control_clips(paired, bucket, start or 0.0, spec)
            own, item_controls = _join(extra, item_controls, bucket, start or 0.0, spec)
            item_id = (
                id_base
                + (f"#{k}" if len(starts) > 1 else "")
                + (f"@{spatial.width}x{spatial.height}" if multi_res else "")
            )
            items.append(
                MediaItem(
                    id=item_id, path=path, caption=full_caption, bucket=bucket, content_key=content, mask_path=mask,
                    clip_start=start, repeats=settings.num_repeats, directory=settings.index,
                    caption_variants=variants, crop_fraction=crop, controls=item_controls, mask_stretched=stretched,
                    has_audio=bool(is_video and info.audio_streams), paired=own,
                )
            )
    if not items and beyond:
        raise _Skip(beyond[0])
    return items


def _own_bucket(width: int, height: int, settings: DirectorySettings, res: object, buckets: _Buckets) -> Bucket:
    """A control image's own bucket (``ModelSpec.control_size = "own"``): of the resolution's buckets, or of the
    image sizes of size_buckets."""
    if settings.size_buckets:
        own = closest_size_bucket(width, height, 1, False, settings.size_buckets, buckets.multiple)
        if own is not None:
            return own
    return buckets.closest(width, height, settings, res if res is not None else settings.resolutions[0])
def _too_far(width: int, height: int, bucket: Bucket, crop: float, settings: DirectorySettings) -> str | None:
    """Why fitting a ``width`` x ``height`` medium to ``bucket`` (resize to cover, center crop) would distort it
    past the dataset's limits (``max_upscale``, ``max_crop``), or None."""
    upscale = max(bucket.width / width, bucket.height / height)
    if upscale > settings.max_upscale:
        return (f"too small: {width}x{height} would be enlarged {upscale:.3g}x to fill the {bucket.width}x"
                f"{bucket.height} bucket (max_upscale = {settings.max_upscale:g})")
    if crop > settings.max_crop:
        return (f"too cropped: the {bucket.width}x{bucket.height} bucket would cut away {crop:.1%} of "
                f"{width}x{height} (max_crop = {settings.max_crop:g})")
    return None


def _paired_controls(
    path: Path, settings: DirectorySettings, index: ScanIndex, controls: list[tuple[ControlFolder, str | None]],
    videos: bool = False,
) -> list[tuple[str, tuple[int, int], str, VideoInfo | None]]:
    """``(control file, (width, height), content key, video info)`` of each control image (``videos``: control
    video) of a target, or raise _Skip naming the control file that is missing or cannot be read."""
    found = []
    what = "control video" if videos else "control image"
    short = "control video" if videos else "control"  # the image controls' reasons as they always were
    for folder, control in controls:
        if control is None:
            raise _Skip(f"no {what}: {folder.expected(target_stem(path, settings.path))} not found "
                        f"({folder.label})")
        try:
            _, facts = index.media(control, VIDEO if videos else IMAGE)  # probed only if new or changed
        except (MediaError, OSError) as exc:
            raise _Skip(f"unreadable {short}: {exc}") from None  # the probe's message names the control file
        if facts is None:
            raise _Skip(f"unreadable {short}: {control}: empty file (0 bytes)")
        size = (facts.width, facts.height) if videos else facts
        found.append((control, size, index.content_key(control), facts if videos else None))
    return found


def _paired_files(path: Path, settings: DirectorySettings, index: ScanIndex,
                  files: Sequence[tuple[str, ControlFolder, str | None]], controls: list) -> list[tuple]:
    """``(role, file, content key, video info or None)`` of each paired file of a target, or raise _Skip naming the
    file that is missing, unreadable, or (a control mask) not the size of its control video."""
    found = []
    for role, folder, file in files:
        what = PAIRED_WHAT[role]
        if file is None:
            raise _Skip(f"no {what}: {folder.expected(target_stem(path, settings.path))} not found ({folder.label})")
        video = os.path.splitext(file)[1].lower() in VIDEO_EXTS
        try:
            _, facts = index.media(file, VIDEO if video else IMAGE)  # probed only if new or changed
        except (MediaError, OSError) as exc:
            raise _Skip(f"unreadable {what}: {exc}") from None  # the probe's message names the file
        if facts is None:
            raise _Skip(f"unreadable {what}: {file}: empty file (0 bytes)")
        if role == "control_mask" and controls:
            size = (facts.width, facts.height) if video else facts
            control, control_size = controls[0][0], controls[0][1]
            if tuple(size) != tuple(control_size):
                raise _Skip(f"{what} size: {file} is {size[0]}x{size[1]} but its control video {control} is "
                            f"{control_size[0]}x{control_size[1]}")
        found.append((role, file, index.content_key(file), facts if video else None))
    return found


def _join(extra: list[tuple], controls: tuple[ControlImage, ...], bucket: Bucket, start: float, spec: ModelSpec
          ) -> tuple[tuple[PairedFile, ...], tuple[ControlImage, ...]]:
    """An item's paired files split into those encoded with the item itself and those that join its first control
    (a control mask; reference images of a model with control images), or raise _Skip naming a mask video too short
    for the clip."""
    own: list[PairedFile] = []
    joined: list[PairedFile] = []
    for role, file, ckey, info in extra:
        if info is not None:  # a mask video: the clip's frames
            fps = float(spec.video_fps) if spec.video_fps else info.fps
            needed = start + (bucket.frames - 1) / fps
            if needed > info.duration + 0.5 / info.fps:
                raise _Skip(f"{PAIRED_WHAT[role]} too short: {file} is {info.duration:.2f}s, the clip needs its "
                            f"frames {start:.2f}s..{needed:.2f}s at {fps:g} fps")
        joins = role == "control_mask" or (role == "reference" and spec.control_images != "none")
        (joined if joins and controls else own).append(PairedFile(role, Path(file), ckey, info is not None))
    if joined:
        controls = (replace(controls[0], paired=tuple(joined)), *controls[1:])
    return tuple(own), controls


def _control_clips(paired: list, bucket: Bucket, start: float, spec: ModelSpec) -> tuple[ControlImage, ...]:
    """The control videos of one clip (``ModelSpec.control_videos``): each paired file at the clip's bucket and
    start, or raise _Skip naming a control video too short to hold the clip's frames."""
    out = []
    for control, _, ckey, info in paired:
        fps = float(spec.video_fps) if spec.video_fps else info.fps
        needed = start + (bucket.frames - 1) / fps
        if needed > info.duration + 0.5 / info.fps:
            raise _Skip(f"control video too short: {control} is {info.duration:.2f}s, the clip needs its frames "
                        f"{start:.2f}s..{needed:.2f}s at {fps:g} fps")
        out.append(ControlImage(Path(control), bucket, ckey, start))
    return tuple(out)


def _id_base(path: Path, settings: DirectorySettings, anchor: Path | None) -> str:
    for base in (anchor, settings.path):
        if base is not None:
            try:
                return path.relative_to(base).as_posix()
            except ValueError:
                continue
    return path.as_posix()


def scan_dataset(
    cfg: DatasetConfig, spec: ModelSpec, strict: bool = False, workers: int | None = None, progress: bool = True,
    report_skipped: bool = True,
) -> ScanResult:
    """Find every usable item of the dataset for model ``spec``; list every file left out, with why.

    ``strict`` keys media content by a SHA-256 of the bytes instead of size+mtime. What each file told the
    last scan is kept in the scan index beside the cache (:mod:`diffpipe_core.data.scan_index`): an unchanged
    file costs one ``stat``; new and changed files are read, on ``workers`` processes (default: every core)
    when there are many. ``result.stats`` counts them. Raises :class:`DatasetError` when nothing is left,
    saying which filter removed how many files, and ``ConfigError`` when frame_buckets do not fit the model.
    ``report_skipped``: warn about each file left out (once per run: a command's own scan does, its workers' not).
    """
    with gc_paused():  # a scan allocates millions of small objects and makes no reference cycles
        return _scan(cfg, spec, strict, workers, progress, report_skipped)


def _scan(
    cfg: DatasetConfig, spec: ModelSpec, strict: bool, workers: int | None, progress: bool, report_skipped: bool
) -> ScanResult:
    settings = [cfg.settings_for(i) for i in range(len(cfg.directory))]
    problems = spec_problems(cfg, settings, spec) + paired_spec_problems(cfg, settings, spec)
    if spec.modality == "video":
        for s in settings:
            key = "size_buckets" if s.size_buckets else "frame_buckets"  # the key the frame counts came from
            where = "" if getattr(cfg.directory[s.index], key) is None else f"directory[{s.index}]."
            problems += frame_bucket_problems(s.frame_buckets, spec, f"{cfg.source or 'dataset'}: {where}", key)
    if problems:
        raise ConfigError(sorted(set(problems)))

    anchor = cfg.source.parent if cfg.source is not None else None
    roots = {s.path.resolve() for s in settings}
    excluded = {s.mask_path.resolve() for s in settings if s.mask_path is not None}
    excluded |= {c.resolve() for s in settings for c in s.control_paths}
    excluded |= {c.resolve() for s in settings for _, folders in s.paired_paths for c in folders}
    if cfg.cache_dir is not None:
        excluded.add(cfg.cache_dir.resolve())

    index = ScanIndex(index_path(cfg.cache_dir, cfg.source, sorted(roots)), strict)
    jobs: list[tuple] = []  # (path, key, ext, settings, captions, id_base, txt key, txt listed): see _prefetch
    folders: dict[int, list[ControlFolder]] = {}
    file_folders: dict[int, list[tuple[str, ControlFolder]]] = {}  # paired-file folders, by role
    unreadable: list[SkippedFile] = []  # archives that cannot be listed
    for s in settings:
        captions = _Captions(s.path, index)
        folders[s.index] = (control_folders(s, VIDEO_EXTS, "video") if spec.control_videos
                            else control_folders(s, IMAGE_EXTS))
        file_folders[s.index] = paired_folders(s, IMAGE_EXTS, VIDEO_EXTS)
        exclude = excluded | (roots - {s.path.resolve()})
        for folder, names in _walk(s.path, exclude):
            present = set(names)
            where, rel = str(folder) + os.sep, _id_base(folder, s, anchor)
            rel = "" if rel == "." else rel + "/"
            for name in names:
                dot = name.rfind(".")
                ext = name[dot:].lower() if dot > 0 else ""  # os.path.splitext's suffix, cheaper
                if name == CAPTIONS_JSON or ext in SIDECAR_EXTS:
                    continue
                if ext == TAR_EXT:
                    try:
                        jobs += _archive_jobs(folder / name, s, captions, rel + name)
                    except (OSError, tarfile.TarError) as exc:
                        why = f"unreadable: not a readable .tar archive ({exc})"
                        unreadable.append(SkippedFile(folder / name, why))
                    continue
                txt = name[: len(name) - len(ext)] + ".txt"
                jobs.append((folder / name, where + name, ext, s, captions, rel + name, where + txt, txt in present))
    if spec.first_frame == "required" or spec.control_videos:  # before any file is read: the model cannot train these
        images = [job[0] for job in jobs if job[2] in IMAGE_EXTS]
        if images:
            raise DatasetError(first_frame_problems(images, spec))
    pairs = _pair(jobs, folders, spec) if any(folders.values()) else {}
    kind = VIDEO if spec.control_videos else IMAGE
    files = _pair_files(jobs, file_folders, spec) if any(file_folders.values()) else {}
    extra = [(c, kind) for found in pairs.values() for _, c in found if c]
    extra += [(c, VIDEO if os.path.splitext(c)[1].lower() in VIDEO_EXTS else IMAGE)
              for found in files.values() for _, _, c in found if c]
    _prefetch(index, jobs, spec, workers, progress, extra)

    result = ScanResult(skipped=list(unreadable))
    seen_ids: set[str] = set()
    buckets = _Buckets(spec.spatial_multiple)

    def run(job: tuple) -> list[MediaItem] | SkippedFile:
        path, key, ext, s, captions, id_base, txt, _ = job
        try:
            return _scan_file(path, s, spec, strict, captions, id_base, index, key, ext, buckets, txt,
                              pairs.get(key, []), files.get(key, []))
        except _Skip as exc:
            return SkippedFile(path, str(exc))
        except Exception as exc:  # anything unexpected still leaves the run going, named
            return SkippedFile(path, f"unreadable: {type(exc).__name__}: {exc}")

    for (_path, _key, _ext, s, *_), outcome in zip(jobs, map(run, jobs)):
        if isinstance(outcome, SkippedFile):
            result.skipped.append(outcome)
            if report_skipped:
                log.warning("left out %s: %s", outcome.path, outcome.reason)
            continue
        for item in outcome:
            if item.id in seen_ids:  # the same file listed by two [[directory]] entries
                item = _with_id(item, f"{item.id}@dir{s.index}")
            seen_ids.add(item.id)
            result.items.append(item)

    index.save()
    n_files = len(jobs) + len(unreadable)
    result.stats = {"files": n_files, **index.stats}
    counts = Counter(reason_category(s.reason) for s in result.skipped)
    summary = f"dataset: {len(result.items)} items from {n_files - len(result.skipped)} files"
    if result.skipped:
        summary += "; left out " + ", ".join(f"{n} {cat}" for cat, n in counts.most_common())
    if cfg.subsample_ratio < 1 and result.items:
        kept = _subsample(result.items, cfg.subsample_ratio)
        summary += f"; subsample_ratio = {cfg.subsample_ratio:g} keeps {len(kept)} of the {len(result.items)} items"
        result.items = kept
    log.info(summary)
    unpaired = no_pair_problems([f for fs in folders.values() for f in fs]) + unpaired_video_problems(
        result.skipped, spec)
    unpaired += no_pair_problems([f for fs in file_folders.values() for _, f in fs]) + paired_problems(result.skipped)
    if unpaired:  # a control_path that pairs with nothing is a wrong folder, not a dataset to train on
        raise DatasetError("\n".join(unpaired), result)
    if not result.items:
        raise DatasetError(_empty_message(cfg, settings, n_files, counts), result,
                           "run `diffpipe data` to list every file and its reason" if n_files else "")
    return result


def _archive_jobs(archive: Path, s: DirectorySettings, captions: _Captions, id_base: str) -> list[tuple]:
    """The scan jobs of a ``.tar`` archive's media members (see :mod:`diffpipe_core.data.archives`). Raises
    ``OSError`` or ``tarfile.TarError`` for an archive that cannot be listed."""
    where = str(archive) + os.sep
    jobs = []
    for member in archives.members(archive, IMAGE_EXTS | VIDEO_EXTS):
        ext = os.path.splitext(member)[1].lower()
        key = where + member
        jobs.append((Path(key), key, ext, s, captions, f"{id_base}/{member}", key[: len(key) - len(ext)] + ".txt",
                     False))
    return jobs


def _subsample(items: list[MediaItem], ratio: float) -> list[MediaItem]:
    """``subsample_ratio``: the ``ratio`` share of the items (at least one) whose id hashes lowest, in scan order;
    the same items on every rank, scan and run."""
    n = max(1, int(len(items) * ratio))
    rank = sorted(items, key=lambda it: hashlib.sha256(it.id.encode()).digest())
    kept = {id(it) for it in rank[:n]}
    return [it for it in items if id(it) in kept]


def _pair(jobs: list[tuple], folders: dict[int, list[ControlFolder]], spec: ModelSpec
          ) -> dict[str, list[tuple[ControlFolder, str | None]]]:
    """Each candidate target of a directory with ``control_path``: its control file in every control folder (None
    where there is none), by the target's path string. Counts every folder's pairs."""
    pairs: dict[str, list[tuple[ControlFolder, str | None]]] = {}
    for path, key, ext, s, *_ in jobs:
        here = folders.get(s.index)
        if not here or not (ext in IMAGE_EXTS or (spec.modality == "video" and ext in VIDEO_EXTS)):
            continue
        stem = target_stem(path, s.path)
        found = [(f, f.find(stem)) for f in here]
        for f, control in found:
            f.paired += control is not None
        pairs[key] = found
    return pairs


def _pair_files(jobs: list[tuple], folders: dict[int, list[tuple[str, ControlFolder]]], spec: ModelSpec
                ) -> dict[str, list[tuple[str, ControlFolder, str | None]]]:
    """Each candidate target of a directory with paired-file folders: ``(role, folder, its file there or None)``
    for every folder, by the target's path string. Counts every folder's pairs."""
    pairs: dict[str, list[tuple[str, ControlFolder, str | None]]] = {}
    for path, key, ext, s, *_ in jobs:
        here = folders.get(s.index)
        if not here or not (ext in IMAGE_EXTS or (spec.modality == "video" and ext in VIDEO_EXTS)):
            continue
        stem = target_stem(path, s.path)
        found = [(role, f, f.find(stem)) for role, f in here]
        for _, f, file in found:
            f.paired += file is not None
        pairs[key] = found
    return pairs


def _prefetch(index: ScanIndex, jobs: list[tuple], spec: ModelSpec, workers: int | None, progress: bool,
              extra: Sequence[tuple[str, str]] = ()) -> None:
    """Stat every candidate media file and its caption file, and the ``extra`` ``(path, kind)`` (control images);
    read the new and changed ones (in parallel).

    A job is ``(path, key, ext, settings, captions, id_base, txt, txt_listed)``: the file as a Path and as a
    string (the scan index's key), its lower-case suffix, its ``[[directory]]`` settings and caption finder,
    its item id, ``name.txt`` beside it as a string and whether the folder listing has that file."""
    files: list[tuple[str, str]] = []
    absent: list[str] = []
    videos = spec.modality == "video"
    for _, key, ext, _, _, _, txt, listed in jobs:
        if ext in IMAGE_EXTS or (videos and ext in VIDEO_EXTS):
            files.append((key, VIDEO if ext in VIDEO_EXTS else IMAGE))
            if listed:
                files.append((txt, TEXT))
            else:
                absent.append(txt)
    index.prefetch(files + list(extra), absent, workers, progress)


def _with_id(item: MediaItem, new_id: str) -> MediaItem:
    from dataclasses import replace

    return replace(item, id=new_id)


def _empty_message(cfg: DatasetConfig, settings: list[DirectorySettings], n_files: int, counts: Counter) -> str:
    dirs = ", ".join(str(s.path) for s in settings)
    if not n_files:
        exts = ", ".join(sorted(IMAGE_EXTS | VIDEO_EXTS))
        return f"the dataset is empty: no files found in {dirs} (looked for {exts})"
    lines = [f"the dataset is empty: all {n_files} files in {dirs} were left out:"]
    for category, n in counts.most_common():
        hint = CATEGORY_HINTS.get(category)
        lines.append(f"  {n} x {category}" + (f" ({hint})" if hint else ""))
    return "\n".join(lines)
