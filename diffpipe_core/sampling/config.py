"""The ``[sample]`` table of ``run.toml`` (pydantic only: imported by every command)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

from diffpipe_core.types import ModelSpec

if TYPE_CHECKING:
    from diffpipe_core.registry import ModelPlugin, PluginInfo, Registry

SAMPLING_HOOKS = ("denoise_init", "denoise_inputs", "denoise_step", "load_decoder", "decode_latents")
"""The hooks a model plugin implements to sample; the rest (loop, guidance, prompts, writing) is the core's."""


def missing_sampling_hooks(plugin: ModelPlugin) -> list[str]:
    """The sampling hooks the model plugin does not implement ([] when it can sample)."""
    return [hook for hook in SAMPLING_HOOKS if not plugin.has(hook)]


def can_sample(info: PluginInfo, registry: Registry) -> bool:
    """Whether a loaded model plugin implements every sampling hook."""
    return info.ok and info.module is not None and not missing_sampling_hooks(registry.model(info.name))


class SampleConfig(BaseModel):
    """``[sample]``: generate samples while training (and the defaults of ``diffpipe sample``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts: list[str] | Path = Field(
        description="The prompts: a list of strings, or a text file with one prompt per line "
        "(blank lines and lines starting with '#' are skipped)."
    )
    negative_prompt: str = Field("", description="Prompt of the unconditional branch when cfg > 1.")
    every_n_steps: int | None = Field(
        None, ge=1, description="Sample every N optimizer steps (training; `diffpipe sample` ignores it)."
    )
    every_n_epochs: int | None = Field(None, ge=1, description="Sample at the end of every N epochs (training).")
    before_first_step: bool = Field(False, description="Also sample before training starts (step 0; training).")
    steps: int = Field(20, ge=1, le=1000, description="Denoising steps.")
    guidance: float | None = Field(
        None,
        ge=0,
        description="The model's embedded guidance value (guidance-distilled models, e.g. Flux dev). "
        "Default: the model plugin's.",
    )
    cfg: float = Field(
        1.0, ge=1.0, description="Classifier-free guidance scale; above 1 each step also runs negative_prompt."
    )
    seed: int = Field(0, description="Noise seed; prompt i uses the same noise at every sampling point.")
    resolution: int | tuple[int, int] | None = Field(
        None,
        description="Sample size in pixels: one number (square) or [width, height]. Default: the dataset's first "
        "resolution (a side length gives its square; rounded down to the model's multiple), or 512 without a dataset.",
    )
    frames: int | None = Field(
        None,
        ge=1,
        description="Video models: frame count (frame_multiple * k + frame_offset of the model). Default: the "
        "dataset's first frame bucket above 1 that fits the model, else the smallest valid count above 1.",
    )

    control_images: list[Path | list[Path]] | None = Field(
        None,
        description="Edit models (those that train on [[directory]] control_path): each prompt's control image, or "
        "a list of them in control_path order, as paths relative to the run config; one entry per prompt. Each is "
        "decoded at the sample size (or at its own aspect ratio, if the model asks for that: at the sample's pixel "
        "count, or where the model's pipeline fixes one, at that size, Qwen-Image-Edit's 1024x1024) and encoded as "
        "in training.",
    )

    @field_validator("prompts")
    @classmethod
    def _some_prompts(cls, value: list[str] | Path) -> list[str] | Path:
        if isinstance(value, list) and not value:
            raise ValueError("give at least one prompt (a list of strings, or a file)")
        return value

    @property
    def size(self) -> tuple[int, int] | None:
        """``(width, height)`` in pixels, or None for the dataset's (see :func:`sample_shape`)."""
        if isinstance(self.resolution, int):
            return self.resolution, self.resolution
        return self.resolution

    def control_list(self) -> list[list[Path]] | None:
        """Each prompt's control images (a list each), or None without ``control_images``."""
        if self.control_images is None:
            return None
        return [list(c) if isinstance(c, list) else [c] for c in self.control_images]

    def prompt_list(self) -> list[str]:
        """The prompts, read from the file when ``prompts`` names one."""
        if isinstance(self.prompts, list):
            return list(self.prompts)
        return read_prompt_file(self.prompts)


def read_prompt_file(path: Path) -> list[str]:
    """One prompt per line; blank lines and ``#`` comments are skipped."""
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    prompts = [line for line in lines if line and not line.startswith("#")]
    if not prompts:
        raise ValueError(f"{path}: no prompts (one per line; blank lines and '#' lines are skipped)")
    return prompts


def default_frames(spec: ModelSpec) -> int:
    """Images: 1. Videos: the smallest ``frame_multiple * k + frame_offset`` above 1."""
    if spec.modality == "image":
        return 1
    k = 0
    while spec.frame_multiple * k + spec.frame_offset <= 1:
        k += 1
    return spec.frame_multiple * k + spec.frame_offset


DEFAULT_SIZE = 512
"""Sample width and height when neither ``[sample] resolution`` nor a dataset says."""


def dataset_shape(dataset_toml: Path | None, spec: ModelSpec) -> tuple[int, int, int] | None:
    """``(width, height, frames)`` of the dataset's first resolution and frame bucket (its first
    ``[[directory]]``'s effective settings), rounded to what the model takes; None when there is no dataset file.

    A side length ``r`` gives the ``r x r`` square, a ``[w, h]`` pair that size, each rounded down to the model's
    ``spatial_multiple``. Frames: 1 for an image model; for a video model the first frame bucket above 1 that fits
    ``frame_multiple * k + frame_offset``, else :func:`default_frames`. Reads the TOML only: its folders need
    not exist (``diffpipe sample`` builds no dataset). Raises ConfigError for a TOML that does not validate."""
    if dataset_toml is None or not dataset_toml.is_file():
        return None
    from diffpipe_core.data.buckets import round_size, valid_frame_count
    from diffpipe_core.data.dataset_config import DatasetConfig
    from diffpipe_core.schema import read_toml, validate

    dataset = validate(DatasetConfig, read_toml(dataset_toml), str(dataset_toml))
    settings = dataset.settings_for(0)
    m = spec.spatial_multiple
    res = settings.resolutions[0]
    if isinstance(res, tuple):
        width, height = (max(m, side // m * m) for side in res)
    else:
        width, height = round_size(float(res * res), 1.0, m)
    frames = 1
    if spec.modality == "video":
        fitting = [f for f in settings.frame_buckets if f > 1 and valid_frame_count(f, spec)]
        frames = fitting[0] if fitting else default_frames(spec)
    return width, height, frames


def sample_shape(
    sample: SampleConfig, spec: ModelSpec, dataset: tuple[int, int, int] | None
) -> tuple[int, int, int]:
    """``(width, height, frames)`` to sample: ``[sample]``'s when given, else the dataset's (:func:`dataset_shape`),
    else 512 px and :func:`default_frames`."""
    base = dataset or (DEFAULT_SIZE, DEFAULT_SIZE, default_frames(spec))
    width, height = sample.size or base[:2]
    frames = sample.frames if sample.frames is not None else base[2]
    return width, height, frames


def sample_problems(sample: SampleConfig, plugin: ModelPlugin, source: str, when: bool = True) -> list[str]:
    """What in ``[sample]`` does not fit the model (sizes, frame counts, a plugin that cannot sample) or cannot
    be read (the prompt file). With ``when`` (training), also a table that never says when to sample."""
    spec = plugin.spec
    problems = []
    missing = missing_sampling_hooks(plugin)
    if missing:
        problems.append(
            f"{source}: sample: model plugin {spec.name!r} cannot sample (it does not implement "
            f"{', '.join(missing)}); remove [sample] (`diffpipe models` shows which plugins can sample)"
        )
    if when and not (sample.every_n_steps or sample.every_n_epochs or sample.before_first_step):
        problems.append(
            f"{source}: sample: say when to sample: every_n_steps, every_n_epochs and/or before_first_step = true"
        )
    m = spec.spatial_multiple
    for key, value in zip(("width", "height"), sample.size or (m, m), strict=True):
        if value < m or value % m:
            lower, upper = max(m, value // m * m), (value // m + 1) * m
            problems.append(
                f"{source}: sample.resolution: {key} {value} is not a multiple of {m} (model {spec.name!r}); "
                f"use e.g. {lower} or {upper}"
            )
    if sample.frames is not None:
        if spec.modality == "image" and sample.frames != 1:
            problems.append(
                f"{source}: sample.frames: {sample.frames}, but model {spec.name!r} makes images; leave it out"
            )
        elif spec.modality == "video" and (sample.frames - spec.frame_offset) % spec.frame_multiple:
            k = max(0, (sample.frames - spec.frame_offset) // spec.frame_multiple)
            near = [spec.frame_multiple * j + spec.frame_offset for j in (k, k + 1)]
            problems.append(
                f"{source}: sample.frames: {sample.frames} does not fit model {spec.name!r} "
                f"({spec.frame_multiple} * k + {spec.frame_offset}); use e.g. {near[0]} or {near[1]}"
            )
    if isinstance(sample.prompts, Path):
        if not sample.prompts.is_file():
            problems.append(f"{source}: sample.prompts: file not found: {sample.prompts}")
        else:
            try:
                read_prompt_file(sample.prompts)
            except (ValueError, UnicodeDecodeError) as exc:
                problems.append(f"{source}: sample.prompts: {exc}")
    problems += _control_problems(sample, spec, source)
    return problems


def _control_problems(sample: SampleConfig, spec: ModelSpec, source: str) -> list[str]:
    """``control_images``: for an edit model only, one entry per prompt, existing files, at most the model's count."""
    controls = sample.control_list()
    if controls is None:
        return []
    if spec.control_images == "none":
        return [f"{source}: sample.control_images: model {spec.name!r} takes no control images; leave it out"]
    problems = []
    try:
        n_prompts = len(sample.prompt_list())
    except (OSError, ValueError, UnicodeDecodeError):
        n_prompts = len(controls)  # the prompts file's own problem is reported above
    if len(controls) != n_prompts:
        problems.append(
            f"{source}: sample.control_images: {len(controls)} entries for {n_prompts} prompts; give one per prompt"
        )
    for i, images in enumerate(controls):
        if len(images) > spec.max_control_images:
            problems.append(
                f"{source}: sample.control_images[{i}]: {len(images)} images; model {spec.name!r} takes at most "
                f"{spec.max_control_images}"
            )
        problems += [f"{source}: sample.control_images[{i}]: file not found: {p}" for p in images if not p.is_file()]
    return problems
