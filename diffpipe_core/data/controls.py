"""Conditioned datasets: edit pairs (``[[directory]] control_path``) and image-to-video items, as the scan sees them.

A target pairs with the control image of the same relative folder and stem in each control folder (``a/b.png`` in
the media folder <-> ``a/b.jpg`` in the control folder). Each control folder is listed once per scan, so pairing
costs a dict lookup per target. What the model accepts (``ModelSpec.control_images``, ``max_control_images``,
``first_frame``) is checked here before any file is read.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from diffpipe_core.data.archives import beside_archive
from diffpipe_core.data.dataset_config import DatasetConfig, DirectorySettings
from diffpipe_core.types import ModelSpec

log = logging.getLogger("diffpipe.data")


class ControlFolder:
    """The image files of one control folder, by relative folder and stem (``"a/b"``), listed once."""

    def __init__(self, root: Path, number: int, many: bool, directory: int, image_exts: frozenset[str],
                 what: str = "image", key: str = "control_path") -> None:
        self.root, self.what, self.key = root, what, key
        self.number = number  # position in control_path (or the paired files' key)
        self.directory = directory
        self.label = f"directory[{directory}].{key}" + (f"[{number}]" if many else "")
        self.paired = 0  # targets that found a control file here (decodable or not)
        self.by_stem: dict[str, str] = {}
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            rel = os.path.relpath(folder, root)
            prefix = "" if rel == "." else Path(rel).as_posix() + "/"
            for name in sorted(files):
                dot = name.rfind(".")
                if name.startswith(".") or dot <= 0 or name[dot:].lower() not in image_exts:
                    continue
                stem = prefix + name[:dot]
                if stem in self.by_stem:
                    log.warning("%s: %s and %s share a stem; pairing targets named %s with the first",
                                self.label, self.by_stem[stem], os.path.join(folder, name), stem)
                    continue
                self.by_stem[stem] = os.path.join(folder, name)

    def find(self, stem: str) -> str | None:
        """The control file for a target at relative path ``stem`` (posix, no suffix), or None."""
        return self.by_stem.get(stem)

    def expected(self, stem: str) -> str:
        """How a missing control file would be named, for the skip reason."""
        return str(self.root / stem) + f".<{self.what} extension>"


def control_folders(settings: DirectorySettings, exts: frozenset[str], what: str = "image") -> list[ControlFolder]:
    """The listed control folders of one ``[[directory]]`` (empty without ``control_path``); ``exts``: the control
    files' suffixes (images, or videos for ``ModelSpec.control_videos``, ``what`` = ``"video"``)."""
    many = len(settings.control_paths) > 1
    return [ControlFolder(p, k, many, settings.index, exts, what) for k, p in enumerate(settings.control_paths)]


def target_stem(path: Path, root: Path) -> str:
    """A target's pairing key: its path relative to its media folder, posix, without the suffix (an archive
    member's as if it were beside its archive)."""
    rel = beside_archive(path).relative_to(root)
    return (rel.parent / rel.stem).as_posix()


def spec_problems(cfg: DatasetConfig, settings: list[DirectorySettings], spec: ModelSpec) -> list[str]:
    """What the dataset asks of the model that it does not do (control images it does not take, too many of them,
    a directory without the control images it needs); one message each, naming the key."""
    where = cfg.source or "dataset"
    problems = []
    for s in settings:
        n = len(s.control_paths)
        if n and spec.control_images == "none":
            problems.append(f"{where}: directory[{s.index}].control_path: model {spec.name!r} does not train on "
                            "control images (edit pairs); remove control_path or use an edit model")
        elif n > spec.max_control_images:
            problems.append(f"{where}: directory[{s.index}].control_path: {n} control folders, but model "
                            f"{spec.name!r} takes at most {spec.max_control_images} control image"
                            f"{'s' if spec.max_control_images != 1 else ''} per target")
        elif not n and spec.control_images == "required":
            problems.append(f"{where}: directory[{s.index}]: model {spec.name!r} trains on edit pairs only; give "
                            "control_path = the folder of control images paired with this directory's targets")
    return problems


def no_pair_problems(folders: list[ControlFolder]) -> list[str]:
    """A control (or paired-file) folder that pairs with no target at all: the config points at the wrong folder."""
    return [
        f"{f.label}: {f.root} has no control image paired with a target of directory[{f.directory}] "
        "(controls pair by relative path and stem: a/b.png in the media folder <-> a/b.jpg in the control folder)"
        if f.key == "control_path" else
        f"{f.label}: {f.root} has no file paired with a target of directory[{f.directory}] (files pair by relative "
        "path and stem: a/b.mp4 in the media folder <-> a/b.png in this folder)"
        for f in folders if f.paired == 0
    ]


# ---------------------------------------------------------------------------------------------- paired files
#: what a paired file of each role is called in messages, and the suffixes its folder is listed for
PAIRED_WHAT = {"control_mask": "control mask", "reference": "reference image", "last_frame": "last frame"}


def paired_folders(settings: DirectorySettings, image_exts: frozenset[str], video_exts: frozenset[str]
                   ) -> list[tuple[str, ControlFolder]]:
    """``(role, folder)`` of each paired-file folder of one ``[[directory]]`` (``ModelSpec.paired_files``), in
    role and list order."""
    out = []
    for role, folders in settings.paired_paths:
        exts, what = (image_exts | video_exts, "video or image") if role == "control_mask" else (image_exts, "image")
        out += [(role, ControlFolder(p, k, len(folders) > 1, settings.index, exts, what, f"{role}_path"))
                for k, p in enumerate(folders)]
    return out


def paired_spec_problems(cfg: DatasetConfig, settings: list[DirectorySettings], spec: ModelSpec) -> list[str]:
    """A paired-file key the model does not read, naming the key and what the model reads."""
    where = cfg.source or "dataset"
    reads = ", ".join(f"{r}_path" for r in spec.paired_files) or "none"
    return [f"{where}: directory[{s.index}].{role}_path: model {spec.name!r} does not read {PAIRED_WHAT[role]}s "
            f"(paired-file keys it reads: {reads}); remove the key or use a model that reads them"
            for s in settings for role, _ in s.paired_paths if role not in spec.paired_files]


def paired_problems(skipped: list) -> list[str]:
    """An item left out for a paired file (missing, unreadable, of another size, too short) is an error: each,
    naming the item and the file."""
    whats = tuple(PAIRED_WHAT.values())
    return [f"{s.path}: {s.reason}" for s in skipped if any(w in s.reason.split(":", 1)[0] for w in whats)]


def first_frame_problems(images: list[Path], spec: ModelSpec) -> str:
    """The error for images in the dataset of an image-to-video-only model (or one trained on control videos,
    ``ModelSpec.control_videos``), naming the files."""
    shown = ", ".join(map(str, images[:5])) + (f" and {len(images) - 5} more" if len(images) > 5 else "")
    what = ("video-to-video only (each item is a video clip paired with its control video)" if spec.control_videos
            else "image-to-video only (each item is a video clip conditioned on its first frame)")
    return (f"{len(images)} image{'s' if len(images) != 1 else ''} in the dataset, but model {spec.name!r} trains "
            f"{what}: {shown}; remove {'them' if len(images) != 1 else 'it'} or use videos")


def unpaired_video_problems(skipped: list, spec: ModelSpec) -> list[str]:
    """A model trained on control videos cannot train a clip without its control video: each clip left out for
    its control (missing, unreadable, too short), naming both files; empty for other models."""
    if not spec.control_videos:
        return []
    return [f"{s.path}: {s.reason}" for s in skipped if CONTROL_REASON in s.reason]


CONTROL_REASON = "control video"  # in every reason a clip is left out for its control video
