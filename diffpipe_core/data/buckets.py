"""Training shapes: aspect-ratio buckets per resolution and frame buckets for videos.

A resolution gives an area (``512`` -> 512*512, ``[w, h]`` -> w*h); each aspect ratio ``a`` (width /
height) gives the size ``(sqrt(area*a), sqrt(area/a))`` rounded down to the model's spatial multiple.
An item goes to the bucket whose (rounded) aspect ratio is closest to its own in log space. Videos go to
the largest frame bucket they fill after resampling to the model's frame rate.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from diffpipe_core.data.dataset_config import DirectorySettings, Resolution
from diffpipe_core.data.items import Bucket
from diffpipe_core.types import ModelSpec


def round_size(area: float, ar: float, multiple: int) -> tuple[int, int]:
    """(width, height) with ``width / height ~= ar`` and ``width * height ~= area``, each rounded down
    to ``multiple`` (never below one multiple)."""
    w = math.sqrt(area * ar)
    h = math.sqrt(area / ar)
    return max(multiple, int(w // multiple) * multiple), max(multiple, int(h // multiple) * multiple)


def aspect_ratios(settings: DirectorySettings) -> list[float]:
    """The aspect ratios (width / height) bucketed for this directory: explicit, or log-spaced."""
    if not settings.enable_ar_bucket:
        return [1.0]
    if settings.ar_buckets is not None:
        return sorted(set(settings.ar_buckets))
    n = settings.num_ar_buckets
    lo, hi = math.log(settings.min_ar), math.log(settings.max_ar)
    if n == 1:
        return [math.exp((lo + hi) / 2)]
    return [math.exp(lo + (hi - lo) * i / (n - 1)) for i in range(n)]


@functools.lru_cache(maxsize=1024)
def spatial_buckets(resolution: Resolution, settings: DirectorySettings, multiple: int) -> tuple[Bucket, ...]:
    """The distinct (width, height) buckets of one resolution, sorted by aspect ratio."""
    if isinstance(resolution, tuple):
        w, h = resolution
        if not settings.enable_ar_bucket:
            return (Bucket(max(multiple, w // multiple * multiple), max(multiple, h // multiple * multiple)),)
        area = float(w * h)
    else:
        area = float(resolution * resolution)
    sizes = {round_size(area, ar, multiple) for ar in aspect_ratios(settings)}
    return tuple(sorted((Bucket(w, h) for w, h in sizes), key=lambda b: b.width / b.height))


def closest_bucket(width: int, height: int, buckets: Sequence[Bucket]) -> Bucket:
    """The bucket whose aspect ratio is closest (in log space) to ``width / height``."""
    target = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b.width / b.height) - target), -b.width * b.height))


def closest_size_bucket(
    width: int, height: int, frames: int, is_video: bool, sizes: Sequence[tuple[int, int, int]], multiple: int
) -> Bucket | None:
    """diffusion-pipe's ``size_buckets``: of the ``(width, height, frames)`` sizes whose frame count an item fills
    (a video: more than one frame, at most ``frames``; an image: one), the one closest in aspect ratio (log space;
    ties: the most frames), its sides rounded down to ``multiple``. None when no size fits."""
    fitting = [s for s in sizes if (1 < s[2] <= frames if is_video else s[2] == 1)]
    if not fitting:
        return None
    target = math.log(width / height)
    w, h, f = min(fitting, key=lambda s: (abs(math.log(s[0] / s[1]) - target), -s[2]))
    return Bucket(max(multiple, w // multiple * multiple), max(multiple, h // multiple * multiple), f)


def valid_frame_count(frames: int, spec: ModelSpec) -> bool:
    """Whether a video frame count fits the model: ``frame_multiple * k + frame_offset``."""
    if frames < max(1, spec.frame_offset):
        return False
    return (frames - spec.frame_offset) % max(1, spec.frame_multiple) == 0


def frame_bucket_problems(
    frame_buckets: Sequence[int], spec: ModelSpec, where: str, key: str = "frame_buckets"
) -> list[str]:
    """One message per frame bucket the model cannot take, naming the closest valid counts (and ``key``, where the
    counts were given)."""
    problems = []
    step, offset = max(1, spec.frame_multiple), spec.frame_offset
    for f in frame_buckets:
        if f == 1 or valid_frame_count(f, spec):
            continue
        lower = offset + (f - offset) // step * step
        choices = [c for c in (lower, lower + step) if c >= max(2, offset)]
        problems.append(
            f"{where}{key}: {f} frames does not fit model {spec.name!r} (frame counts must be "
            f"{step}*k + {offset}); use {' or '.join(map(str, choices))}"
        )
    return problems


def video_frame_bucket(available_frames: int, frame_buckets: Sequence[int]) -> int | None:
    """The largest frame bucket (>1 frames) that ``available_frames`` fills, or None if too short."""
    fitting = [f for f in frame_buckets if 1 < f <= available_frames]
    return max(fitting) if fitting else None


def resampled_frame_count(duration_s: float, fps: float) -> int:
    """How many frames a video of ``duration_s`` seconds yields at ``fps``: the times k / fps (k >= 0)
    strictly before the end, so the ceiling of ``duration_s * fps`` (26 frames at 24 fps give 9 at 8 fps;
    a 1-frame clip gives 1)."""
    return max(0, math.ceil(duration_s * fps - 1e-6))


def clip_starts(available_frames: int, clip_frames: int, mode: str) -> list[int]:
    """Start frames (at the resampled rate) of the clips taken from a video by ``video_clip_mode``."""
    spare = available_frames - clip_frames
    if spare < 0:
        return []
    if mode == "single_beginning":
        return [0]
    if mode == "single_middle":
        return [spare // 2]
    if mode == "multiple_overlapping":
        n = math.ceil(available_frames / clip_frames)
        if n <= 1:
            return [0]
        return sorted({round(i * spare / (n - 1)) for i in range(n)})
    raise ValueError(f"unknown video_clip_mode {mode!r}")
