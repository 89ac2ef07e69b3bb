"""The dataset TOML: schema, loading and validation.

Key names follow tdrussell/diffusion-pipe where the concept is the same. Relative paths resolve
against the directory of the dataset TOML. Every ``[[directory]]`` entry may override the bucketing,
frame and caption keys of the top level; :meth:`DatasetConfig.settings_for` merges them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from diffpipe_core.anchor.keys import dataset_hint
from diffpipe_core.schema import ConfigError, read_toml, validate

Resolution = int | tuple[int, int]
SizeBucket = tuple[int, int] | tuple[int, int, int]
AspectRatio = float | tuple[int, int]
ClipMode = Literal["single_beginning", "single_middle", "multiple_overlapping"]

DEFAULT_MIN_AR = 0.5
DEFAULT_MAX_AR = 2.0


def _check_resolutions(value: list[Resolution] | None) -> list[Resolution] | None:
    if value is None:
        return value
    if not value:
        raise ValueError("give at least one resolution, e.g. [512] or [[768, 512]]")
    for res in value:
        sides = res if isinstance(res, tuple) else (res,)
        if any(s < 16 for s in sides):
            raise ValueError(f"resolution {res!r} is too small; sides must be at least 16 pixels")
    return value


def _check_ar_buckets(value: list[AspectRatio] | None) -> list[AspectRatio] | None:
    if value is None:
        return value
    if not value:
        raise ValueError("give at least one aspect ratio (width / height), or leave ar_buckets out")
    for ar in value:
        if isinstance(ar, tuple):
            if ar[0] <= 0 or ar[1] <= 0:
                raise ValueError(f"[width, height] pair {list(ar)!r} must be positive")
        elif ar <= 0:
            raise ValueError(f"aspect ratio {ar!r} must be positive (width / height)")
    return value


def _check_size_buckets(value: list[SizeBucket] | None) -> list[SizeBucket] | None:
    if value is None:
        return value
    if not value:
        raise ValueError("give at least one [width, height, frames] size, or leave size_buckets out")
    for size in value:
        if any(s < 16 for s in size[:2]):
            raise ValueError(f"size {list(size)!r}: width and height must be at least 16 pixels")
        if len(size) == 3 and size[2] < 1:
            raise ValueError(f"size {list(size)!r}: the frame count must be at least 1")
    return value


def _check_frame_buckets(value: list[int] | None) -> list[int] | None:
    if value is None:
        return value
    if not value:
        raise ValueError("give at least one frame count, e.g. [1, 33]")
    if any(f < 1 for f in value):
        raise ValueError("frame counts must be at least 1")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Overridable(_Strict):
    """Keys that the top level sets and each ``[[directory]]`` may override (None = inherit)."""

    resolutions: list[Resolution] | None = Field(
        None,
        description="Training resolutions: a side length (512 means a 512x512 area) or a "
        "[width, height] pair (its area; without AR bucketing exactly that size). Each item is used once "
        "per resolution.",
    )
    enable_ar_bucket: bool | None = Field(
        None, description="Bucket items by aspect ratio instead of center-cropping everything to one shape."
    )
    min_ar: float | None = Field(
        None,
        gt=0,
        description="Smallest bucket aspect ratio (width / height) when AR bucketing is on; narrower items go "
        "to the nearest bucket, cropped (or are left out with drop_outside_ar). Default 0.5, or the smallest "
        "of ar_buckets.",
    )
    max_ar: float | None = Field(
        None,
        gt=0,
        description="Largest bucket aspect ratio (width / height) when AR bucketing is on; wider items go to "
        "the nearest bucket, cropped (or are left out with drop_outside_ar). Default 2.0, or the largest of "
        "ar_buckets.",
    )
    drop_outside_ar: bool | None = Field(
        None,
        description="Leave out items whose aspect ratio is outside min_ar..max_ar. Default false: they go to the "
        "nearest bucket, center-cropped, as in diffusion-pipe.",
    )
    num_ar_buckets: int | None = Field(
        None,
        ge=1,
        description="Number of aspect-ratio buckets, log-spaced between min_ar and max_ar. Default 7.",
    )
    ar_buckets: list[AspectRatio] | None = Field(
        None,
        description="Explicit aspect-ratio buckets: ratios (width / height) or [width, height] pairs. "
        "Overrides num_ar_buckets.",
    )
    frame_buckets: list[int] | None = Field(
        None,
        description="Video frame counts to train on (after resampling to the model's frame rate); each video "
        "goes to the largest bucket it fills. Counts must fit the model (frame_multiple * k + frame_offset). "
        "Images are always 1 frame. Default [1].",
    )
    size_buckets: list[SizeBucket] | None = Field(
        None,
        description="Exact training sizes instead of resolutions x aspect ratios (diffusion-pipe's key): [width, "
        "height] or [width, height, frames] each; an item goes to the size of the closest aspect ratio among those "
        "whose frame count it fills (images: frames 1), once. Sizes are rounded down to the model's multiple; the "
        "frame counts replace frame_buckets.",
    )
    video_clip_mode: ClipMode | None = Field(
        None,
        description="Which frames of a video to use: 'single_beginning' (one clip from the start), "
        "'single_middle' (one clip from the middle) or 'multiple_overlapping' (as few evenly spaced, "
        "possibly overlapping clips as cover the whole video). Default 'single_beginning'.",
    )
    caption_prefix: str | None = Field(
        None, description="Text put in front of every caption, as is (include a trailing space or comma)."
    )
    shuffle_tags: bool | None = Field(
        None,
        description="Treat captions as tag lists and cache shuffled orders of them (the prefix stays first).",
    )
    tag_delimiter: str | None = Field(
        None, description="What separates tags when shuffle_tags is on. Default ', '."
    )
    cache_shuffle_num: int | None = Field(
        None,
        ge=1,
        description="How many shuffled caption variants are cached per item when shuffle_tags is on. "
        "Default 4.",
    )
    allow_empty_captions: bool | None = Field(
        None,
        description="Keep items without a caption (trained with an empty prompt). When false they are "
        "left out with a warning. Default false.",
    )
    max_upscale: float | None = Field(
        None,
        ge=1.0,
        description="Leave out (with the reason, listed by diffpipe data) media that would be enlarged more than "
        "this many times to fill its bucket (a 16 px icon at 512). Default 8.",
    )
    max_crop: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Leave out (with the reason) media whose center crop to its bucket's shape would cut away more "
        "than this share of it (a 20000x20 sliver in a square bucket). Default 0.9.",
    )

    _check_res = field_validator("resolutions")(_check_resolutions)
    _check_ar = field_validator("ar_buckets")(_check_ar_buckets)
    _check_frames = field_validator("frame_buckets")(_check_frame_buckets)
    _check_sizes = field_validator("size_buckets")(_check_size_buckets)


class DirectoryConfig(_Overridable):
    """One ``[[directory]]`` entry: a folder of media and captions."""

    path: Path = Field(
        description="Folder of images/videos (searched recursively) with captions beside them."
    )
    num_repeats: int = Field(
        1, ge=1, description="How many times each item of this folder is seen per epoch."
    )
    mask_path: Path | None = Field(
        None,
        description="Folder of grayscale loss masks named like the media (any image extension, same relative "
        "path); white = train, black = ignore. Items without a mask train on the whole image.",
    )
    default_mask_file: Path | None = Field(
        None,
        description="A grayscale mask image for every item of this folder without its own mask in mask_path "
        "(stretched to each item's size before the crop); white = train, black = ignore.",
    )
    control_path: Path | list[Path] | None = Field(
        None,
        description="Edit pairs: a folder of control images paired with the targets by relative path and stem "
        "(a/b.png <-> a/b.jpg in this folder), or a list of folders for several control images per target, in "
        "order. Buckets follow the target; each control image is resized and center-cropped to the target's "
        "bucket (or to its own, where the model says so). A target without its control image, or with one that "
        "cannot be decoded, is left out with a warning (diffpipe data lists them). Only for models that train "
        "on control images (diffpipe models). Video-to-video models (wan-vace, wan-fun) pair each clip with a "
        "control video instead, decoded at the clip's own frames and bucket; there a clip without its control video "
        "(missing, unreadable, too short) is an error naming both files.",
    )
    control_mask_path: Path | None = Field(
        None,
        description="Models that read control masks (wan-vace): a folder of mask videos (or one mask image for "
        "every frame) paired with the targets by relative path and stem like control_path, each the size of its "
        "control video and decoded at the same frames and crop (white = the part to generate). Every item of the "
        "directory needs one: a missing or unreadable mask is an error naming the files.",
    )
    reference_path: Path | list[Path] | None = Field(
        None,
        description="Models that read reference images (wan-vace): a folder of images paired with the targets by "
        "relative path and stem, or a list of folders for several per item, in order; each is handed to the model "
        "at its own size (the model fits it as its pipeline does). Every item of the directory needs one per "
        "folder: a missing or unreadable one is an error naming the files.",
    )
    last_frame_path: Path | None = Field(
        None,
        description="Models that read a last frame (wan-flf2v): a folder of images paired with the clips by "
        "relative path and stem, each the last frame its clip is conditioned on (instead of the clip's own last "
        "frame), at its own size (resized as the model's pipeline resizes it). Every clip of the directory needs "
        "one: a missing or unreadable image is an error naming the files.",
    )

    regularization: bool = Field(
        False,
        description="A regularisation (prior) folder: its items keep the model near what it did before training "
        "instead of teaching it their content. What they train toward is regularization_target; how much they count "
        "is loss_weight. See docs/training-methods.md.",
    )
    regularization_target: Literal["captions", "base"] | None = Field(
        None,
        description="With regularization = true: 'captions' (default) trains the items toward their captions' "
        "ordinary target, as kohya's and diffusion-pipe users' regularisation sets do, at no extra cost; 'base' "
        "trains them toward the frozen base model's own prediction for the same noisy latent and caption (the "
        "adapter disabled, or the initial weights of a full fine-tune): one extra forward without gradient per "
        "micro-batch holding such items.",
    )
    loss_weight: float = Field(
        1.0,
        gt=0,
        description="Weight of this folder's items in the loss (kohya's prior_loss_weight for a regularisation "
        "folder): a micro-batch's loss is the mean over its samples of weight x the sample's loss.",
    )

    @model_validator(mode="after")
    def _check_regularization(self) -> DirectoryConfig:
        if self.regularization_target is not None and not self.regularization:
            raise ValueError(
                f"regularization_target = {self.regularization_target!r} is set on a folder without regularization = "
                "true; add regularization = true or leave regularization_target out"
            )
        return self

    @property
    def trains_toward_base(self) -> bool:
        """Whether this folder's items train toward the frozen base model's prediction."""
        return self.regularization and self.regularization_target == "base"

    @field_validator("control_path", "reference_path")
    @classmethod
    def _check_control_path(cls, value: Path | list[Path] | None) -> Path | list[Path] | None:
        if isinstance(value, list):
            if not value:
                raise ValueError("give at least one folder, or leave the key out")
            if len(set(value)) != len(value):
                raise ValueError("the same control folder is listed twice")
        return value

    @property
    def control_paths(self) -> tuple[Path, ...]:
        """The control folders in order (none, one, or several)."""
        if self.control_path is None:
            return ()
        return tuple(self.control_path) if isinstance(self.control_path, list) else (self.control_path,)

    def paired_paths(self) -> dict[str, tuple[Path, ...]]:
        """The folders of the paired files given (``ModelSpec.paired_files``' roles: ``control_mask``,
        ``reference``, ``last_frame``), in order; roles without a folder left out."""
        out: dict[str, tuple[Path, ...]] = {}
        for role, value in (("control_mask", self.control_mask_path), ("reference", self.reference_path),
                            ("last_frame", self.last_frame_path)):
            if value is not None:
                out[role] = tuple(value) if isinstance(value, list) else (value,)
        return out


class DatasetConfig(_Overridable):
    """Top-level keys of the dataset TOML."""

    resolutions: list[Resolution] = Field(
        [512],
        description="Training resolutions: a side length (512 means a 512x512 area) or a "
        "[width, height] pair (its area; without AR bucketing exactly that size). Each item is used once "
        "per resolution.",
    )
    enable_ar_bucket: bool = Field(
        False, description="Bucket items by aspect ratio instead of center-cropping everything to one shape."
    )
    frame_buckets: list[int] = Field(
        [1],
        description="Video frame counts to train on (after resampling to the model's frame rate); each video "
        "goes to the largest bucket it fills. Counts must fit the model (frame_multiple * k + frame_offset). "
        "Images are always 1 frame.",
    )
    video_clip_mode: ClipMode = Field(
        "single_beginning",
        description="Which frames of a video to use: 'single_beginning' (one clip from the start), "
        "'single_middle' (one clip from the middle) or 'multiple_overlapping' (as few evenly spaced, "
        "possibly overlapping clips as cover the whole video).",
    )
    caption_prefix: str = Field("", description="Text put in front of every caption, as is.")
    shuffle_tags: bool = Field(
        False,
        description="Treat captions as tag lists and cache shuffled orders of them (the prefix stays first).",
    )
    tag_delimiter: str = Field(", ", description="What separates tags when shuffle_tags is on.")
    cache_shuffle_num: int = Field(
        4, ge=1, description="How many shuffled caption variants are cached per item when shuffle_tags is on."
    )
    allow_empty_captions: bool = Field(
        False,
        description="Keep items without a caption (trained with an empty prompt). When false they are "
        "left out with a warning.",
    )
    max_upscale: float = Field(
        8.0,
        ge=1.0,
        description="Leave out (with the reason, listed by diffpipe data) media that would be enlarged more than "
        "this many times to fill its bucket (a 16 px icon at 512).",
    )
    max_crop: float = Field(
        0.9,
        ge=0.0,
        le=1.0,
        description="Leave out (with the reason) media whose center crop to its bucket's shape would cut away more "
        "than this share of it (a 20000x20 sliver in a square bucket).",
    )
    uncond_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Fraction of samples trained with the empty prompt (caption dropout); the empty prompt's "
        "embedding is cached once.",
    )
    subsample_ratio: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Train on this fraction of the items (the same ones every epoch and run, chosen by item id); "
        "e.g. 0.1 for a quick eval dataset.",
    )
    cache_dir: Path | None = Field(
        None,
        description="Where cached latents and text embeddings go. Default: 'cache' beside the dataset TOML.",
    )
    trigger_word: str | None = Field(
        None,
        description="The word the adapter learns (ai-toolkit's trigger_word): with diff_output_preservation, every "
        "occurrence of it in a caption is replaced by diff_output_preservation_class to make the item's class prompt.",
    )
    diff_output_preservation: bool = Field(
        False,
        description="ai-toolkit's Differential Output Preservation: for each item of the training (not regularisation) "
        "folders the base model's prediction for its class prompt (the caption with trigger_word replaced by "
        "diff_output_preservation_class; same noisy latent and timestep) is the target of a second prediction of the "
        "trained model on the class prompt, added to the loss times diff_output_preservation_multiplier. The class "
        "prompts' embeddings are cached with the dataset. Needs trigger_word. See docs/training-methods.md.",
    )
    diff_output_preservation_multiplier: float = Field(
        1.0, gt=0, description="Weight of the Differential Output Preservation loss (ai-toolkit's key)."
    )
    diff_output_preservation_class: str = Field(
        "person",
        description="The class word that replaces trigger_word in the class prompts (ai-toolkit's key and default).",
    )

    @model_validator(mode="after")
    def _check_dop(self) -> DatasetConfig:
        if self.diff_output_preservation and not (self.trigger_word or "").strip():
            raise ValueError("diff_output_preservation needs trigger_word (the word in the captions that "
                             "diff_output_preservation_class replaces in the class prompts)")
        return self

    def class_prompt(self, caption: str) -> str:
        """The caption's class prompt: every ``trigger_word`` replaced by ``diff_output_preservation_class``."""
        if not self.trigger_word:
            return caption
        return caption.replace(self.trigger_word, self.diff_output_preservation_class)
    directory: list[DirectoryConfig] = Field(
        description="The media folders ([[directory]] entries); at least one.", min_length=1
    )
    _source: Path | None = PrivateAttr(None)

    @property
    def source(self) -> Path | None:
        """The dataset TOML this config was loaded from (None when built in code)."""
        return self._source

    def settings_for(self, index: int) -> DirectorySettings:
        """The effective settings of ``directory[index]``: its overrides over the top-level keys."""
        d = self.directory[index]

        def pick(key: str) -> Any:
            value = getattr(d, key)
            return getattr(self, key) if value is None else value

        ar_buckets = pick("ar_buckets")
        min_ar = d.min_ar if d.min_ar is not None else self.min_ar
        max_ar = d.max_ar if d.max_ar is not None else self.max_ar
        ratios = [_ratio(a) for a in ar_buckets] if ar_buckets is not None else None
        if min_ar is None:
            min_ar = min(ratios) if ratios else DEFAULT_MIN_AR
        if max_ar is None:
            max_ar = max(ratios) if ratios else DEFAULT_MAX_AR
        num = pick("num_ar_buckets")
        sizes = pick("size_buckets")
        return DirectorySettings(
            index=index,
            path=d.path,
            num_repeats=d.num_repeats,
            mask_path=d.mask_path,
            control_paths=d.control_paths,
            paired_paths=tuple(d.paired_paths().items()),
            resolutions=tuple(pick("resolutions")),
            enable_ar_bucket=pick("enable_ar_bucket"),
            min_ar=float(min_ar),
            max_ar=float(max_ar),
            drop_outside_ar=bool(pick("drop_outside_ar")),
            num_ar_buckets=7 if num is None else num,
            ar_buckets=tuple(ratios) if ratios is not None else None,
            frame_buckets=tuple(sorted({s[2] if len(s) == 3 else 1 for s in sizes} if sizes else set(pick(
                "frame_buckets")))),
            size_buckets=tuple((s[0], s[1], s[2] if len(s) == 3 else 1) for s in sizes) if sizes else None,
            default_mask_file=d.default_mask_file,
            video_clip_mode=pick("video_clip_mode"),
            caption_prefix=pick("caption_prefix"),
            shuffle_tags=pick("shuffle_tags"),
            tag_delimiter=pick("tag_delimiter"),
            cache_shuffle_num=pick("cache_shuffle_num"),
            allow_empty_captions=pick("allow_empty_captions"),
            max_upscale=float(pick("max_upscale")),
            max_crop=float(pick("max_crop")),
        )


def _ratio(ar: AspectRatio) -> float:
    return ar[0] / ar[1] if isinstance(ar, tuple) else float(ar)


@dataclass(frozen=True)
class DirectorySettings:
    """Effective settings of one ``[[directory]]`` (top level merged with its overrides)."""

    index: int
    path: Path
    num_repeats: int
    mask_path: Path | None
    resolutions: tuple[Resolution, ...]
    enable_ar_bucket: bool
    min_ar: float
    max_ar: float
    drop_outside_ar: bool
    num_ar_buckets: int
    ar_buckets: tuple[float, ...] | None  # explicit ratios (width / height), or None for log-spaced
    frame_buckets: tuple[int, ...]
    video_clip_mode: str
    caption_prefix: str
    shuffle_tags: bool
    tag_delimiter: str
    cache_shuffle_num: int
    allow_empty_captions: bool
    control_paths: tuple[Path, ...] = ()  # edit pairs: the control image folders, in order
    paired_paths: tuple[tuple[str, tuple[Path, ...]], ...] = ()  # (role, its folders) of the paired files given
    size_buckets: tuple[tuple[int, int, int], ...] | None = None  # exact (width, height, frames) sizes
    default_mask_file: Path | None = None  # the mask of items without their own
    max_upscale: float = 8.0
    max_crop: float = 0.9


def _resolve(value: Any, base: Path) -> Any:
    if isinstance(value, str) and value:
        p = Path(value).expanduser()
        return str(p if p.is_absolute() else (base / p).resolve())
    return value


def load_dataset_config(path: Path | str) -> DatasetConfig:
    """Read and validate a dataset TOML; raise :class:`ConfigError` listing every problem.

    Relative paths resolve against the TOML's folder; every ``[[directory]]`` path (and mask_path) must
    exist. ``cache_dir`` defaults to ``<toml folder>/cache``.
    """
    path = Path(path).resolve()
    source = str(path)
    data = dict(read_toml(path))
    base = path.parent
    data["cache_dir"] = _resolve(data.get("cache_dir"), base)
    if isinstance(data.get("directory"), list):
        entries = []
        for entry in data["directory"]:
            if isinstance(entry, dict):
                entry = dict(entry)
                for key in ("path", "mask_path", "default_mask_file"):
                    entry[key] = _resolve(entry.get(key), base) if key in entry else None
                for key in ("mask_path", "default_mask_file"):
                    if entry[key] is None:
                        del entry[key]
                for key in ("control_path", "control_mask_path", "reference_path", "last_frame_path"):
                    folders = entry.get(key)
                    if isinstance(folders, list):
                        entry[key] = [_resolve(c, base) for c in folders]
                    elif folders is not None:
                        entry[key] = _resolve(folders, base)
                if entry["path"] is None:
                    del entry["path"]
            entries.append(entry)
        data["directory"] = entries
    elif isinstance(data.get("directory"), dict):
        problems = [f"{source}: directory: write [[directory]] (a list of tables), not [directory]"]
        raise ConfigError(problems)
    cfg = validate(DatasetConfig, data, source, hints=dataset_hint)
    if cfg.cache_dir is None:
        cfg = cfg.model_copy(update={"cache_dir": base / "cache"})
    cfg._source = path

    problems: list[str] = []
    for i, d in enumerate(cfg.directory):
        if not d.path.exists():
            problems.append(f"{source}: directory[{i}].path: directory not found: {d.path}")
        elif not d.path.is_dir():
            problems.append(f"{source}: directory[{i}].path: not a directory: {d.path}")
        if d.mask_path is not None and not d.mask_path.is_dir():
            problems.append(f"{source}: directory[{i}].mask_path: directory not found: {d.mask_path}")
        if d.default_mask_file is not None and not d.default_mask_file.is_file():
            problems.append(f"{source}: directory[{i}].default_mask_file: file not found: {d.default_mask_file}")
        many = isinstance(d.control_path, list)
        for k, folder in enumerate(d.control_paths):
            where = f"{source}: directory[{i}].control_path" + (f"[{k}]" if many else "")
            if not folder.is_dir():
                problems.append(f"{where}: directory not found: {folder}")
            elif folder.resolve() == d.path.resolve():
                problems.append(f"{where}: is the media folder itself; control images go in a folder of their own")
        for role, folders in d.paired_paths().items():
            key = f"{role}_path"
            for k, folder in enumerate(folders):
                where = f"{source}: directory[{i}].{key}" + (f"[{k}]" if len(folders) > 1 else "")
                if not folder.is_dir():
                    problems.append(f"{where}: directory not found: {folder}")
                elif folder.resolve() == d.path.resolve():
                    problems.append(f"{where}: is the media folder itself; paired files go in a folder of their own")
        if d.control_mask_path is not None and not d.control_paths:
            problems.append(f"{source}: directory[{i}].control_mask_path: masks of control videos need control_path "
                            "(the control videos they mask)")
        s = cfg.settings_for(i)
        where = "" if (d.min_ar is None and d.max_ar is None) else f"directory[{i}]."
        if s.enable_ar_bucket and s.min_ar > s.max_ar:
            problems.append(f"{source}: {where}min_ar: {s.min_ar} is larger than max_ar {s.max_ar}")
    if problems:
        raise ConfigError(problems)
    return cfg
