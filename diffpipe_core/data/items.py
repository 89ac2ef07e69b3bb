"""The records passed between the data stages: scan -> bucket -> decode -> encode -> cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, order=True)
class Bucket:
    """A training shape in pixels: width, height and frames (1 for images)."""

    width: int
    height: int
    frames: int = 1

    def __str__(self) -> str:
        return f"{self.width}x{self.height}" + (f"x{self.frames}f" if self.frames > 1 else "")


@dataclass(frozen=True)
class PairedFile:
    """A file paired with an item by relative path and stem from a ``[[directory]]`` key of its role
    (``ModelSpec.paired_files``: ``control_mask_path``, ``reference_path``, ``last_frame_path``), decoded and encoded
    with the item or control it joins and part of that one's cache key (``content_key``, like a target's)."""

    role: str  # "control_mask", "reference", "last_frame"
    path: Path
    content_key: str
    video: bool = False  # a mask video (else an image)


@dataclass(frozen=True)
class ControlImage:
    """One control image of an edit pair: its file, the size it is decoded at (the target's bucket, or its own
    with ``ModelSpec.control_size = "own"``) and its content key (like a target's)."""

    path: Path
    bucket: Bucket
    content_key: str
    clip_start: float | None = None  # a control video (ModelSpec.control_videos): the target clip's start, seconds
    paired: tuple[PairedFile, ...] = ()  # the item's paired files that join its control (a mask, references)


@dataclass(frozen=True)
class MediaItem:
    """One training sample before decoding: a file (or one clip of a video) in one bucket.

    ``id`` is unique and human readable (``relative/path.png`` or ``clip.mp4#2`` for the 3rd clip);
    it is what error messages and non-finite-loss reports name. ``content_key`` identifies the media
    content (size+mtime, or a hash in strict mode) for cache invalidation. ``controls`` are the item's control
    images, in ``control_path`` order (empty for plain items).
    """

    id: str
    path: Path
    caption: str
    bucket: Bucket
    content_key: str
    mask_path: Path | None = None
    clip_start: float | None = None  # seconds, videos only
    repeats: int = 1
    directory: int = 0  # index of the [[directory]] entry it came from
    caption_variants: tuple[str, ...] = ()  # shuffled-tag versions of ``caption`` to cache (shuffle_tags)
    crop_fraction: float = 0.0  # share of the image the center crop to the bucket's aspect ratio cuts away
    controls: tuple[ControlImage, ...] = ()
    mask_stretched: bool = False  # the directory's default_mask_file: stretched to the media's size, then cropped
    has_audio: bool = False  # a video with an audio track (the scan's probe; whether it decodes is seen when caching)
    paired: tuple[PairedFile, ...] = ()  # paired files encoded with the item itself (ModelSpec.paired_files)

    def paired_roles(self) -> tuple[str, ...]:
        """The roles of every paired file of the item, its controls' included, in order (items are batched apart by
        them: a reference image adds a latent frame)."""
        return tuple(f.role for f in (*self.paired, *(f for c in self.controls for f in c.paired)))


@dataclass(frozen=True)
class SkippedFile:
    """A file left out of the dataset, with a reason a user understands."""

    path: Path
    reason: str


@dataclass
class ScanResult:
    """The usable items and the files left out. ``stats`` counts the scan's ``files`` and, from the scan index,
    the files ``read`` (new or changed), ``reused`` (unchanged: one ``stat``) and ``removed``."""

    items: list[MediaItem] = field(default_factory=list)
    skipped: list[SkippedFile] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)


@dataclass
class DecodedMedia:
    """Decoded, resized and cropped media for one item.

    ``pixels``: ``(C, H, W)`` for images, ``(C, F, H, W)`` for videos; float32 in [-1, 1], exactly the
    bucket's size. ``mask``: ``(1, H, W)`` float in [0, 1] or None. ``original_size`` is ``(h, w)``
    before resizing and ``crop_coords`` the crop's top-left ``(top, left)`` in the resized image.
    ``audio``: ``(channels, S)`` float32 when the model takes audio (:class:`~diffpipe_core.types.AudioSpec`), zeros
    with ``audio_present`` False when the item has none; ``audio_note`` names a damaged audio stream the item trains
    without (None when the audio decoded or there is no track).
    """

    pixels: torch.Tensor
    mask: torch.Tensor | None
    original_size: tuple[int, int]
    crop_coords: tuple[int, int]
    audio: torch.Tensor | None = None
    audio_present: bool = False
    audio_note: str | None = None
    paired: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # role -> decoded paired files, in order
