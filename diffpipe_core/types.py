"""Plain data types that cross the plugin boundary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # annotations only: importing the contract must not import torch (fast CLI start)
    import torch


class ModelConfigBase(BaseModel):
    """Base class for a plugin's ``[model]`` schema.

    Subclass it, declare fields with types, defaults and ``Field(description=...)``; unknown keys are
    rejected with a close spelling, and every field appears in ``diffpipe config-reference``.
    ``type`` (the model name), ``dtype`` and ``quantize`` are common to every model.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    quantize: Literal["nf4", "int8", "float8"] | None = Field(
        None,
        description="Quantize the frozen base weights while each pipeline stage loads (LoRA only): 'nf4' or 'int8' "
        "(bitsandbytes), 'float8' (float8_e4m3 storage, per-tensor scale, computed in dtype). Every nn.Linear of "
        "the model's blocks except float32-kept and tiny ones (< 4096 weights); embedders and the final layer keep "
        "dtype. LoRA trains on top; the base is never saved.",
    )


@dataclass(frozen=True)
class ModelSpec:
    """What the core needs to know about a model before loading anything.

    Attributes:
        name: the model name; must equal the entry-point name.
        modality: ``"image"`` or ``"video"``.
        config_schema: the pydantic class validating the run config's ``[model]`` table.
        spatial_multiple: pixel sizes are rounded down to a multiple of this (VAE factor x patch).
        frame_multiple / frame_offset: video frame counts are ``frame_multiple * k + frame_offset``.
        video_fps: frame rate videos are resampled to (video models only).
        supports_full_finetune / supports_lora: what training modes the plugin allows.
        encoder_settings: names of ``[model]`` keys that change encoder outputs; the cache is rebuilt
            when one of them changes.
        block_layers: class names of the layers ``split_into_layers`` returns for the model's repeated blocks
            (e.g. ``("DoubleBlockLayer", "SingleBlockLayer")``). ``blocks_to_swap`` and activation
            checkpointing act on these; with none declared, checkpointing covers every layer and no block swaps.
        adapter_formats: LoRA formats ``[adapter] save_formats`` may name for this model; ``"diffusers"``
            is always written. ``diffpipe validate`` and the start of ``train`` refuse any other name.
        model_formats: full fine-tune formats ``save_model_formats`` may name (what ``export_model`` writes).
        description: one line shown by ``diffpipe models``.
    """

    name: str
    modality: Literal["image", "video"]
    config_schema: type[ModelConfigBase]
    spatial_multiple: int = 16
    frame_multiple: int = 1
    frame_offset: int = 0
    video_fps: float | None = None
    supports_full_finetune: bool = True
    supports_lora: bool = True
    encoder_settings: tuple[str, ...] = ()
    block_layers: tuple[str, ...] = ()
    adapter_formats: tuple[str, ...] = ("diffusers",)
    model_formats: tuple[str, ...] = ()
    description: str = ""


@dataclass
class EncodeBatch:
    """One batch handed to ``encode_batch`` while caching.

    The core encodes media and captions in separate calls so that each is cached (and invalidated)
    on its own: a media batch has ``pixels`` set and ``captions`` None, a caption batch the reverse.

    A batch is bucket-homogeneous: every sample has the same shape, so the batch is all images or all
    videos of one frame count. A video model gets both kinds and must encode both.

    Attributes:
        pixels: float RGB in [-1, 1]. Images arrive 4-D ``(B, 3, H, W)``, also in a video model (there is
            no frame axis: add one yourself if your VAE wants ``(B, 3, 1, H, W)``); videos arrive 5-D
            ``(B, 3, F, H, W)`` with ``F`` one of the dataset's ``frame_buckets``.
        captions: the caption strings. Each returned text tensor must have the same length for every
            caption (pad or truncate to a fixed token count): cached samples are stacked into micro-batches.
        masks: ``(B, 1, H, W)`` loss masks in [0, 1] at the pixel size (white = train), or None when the
            dataset has no ``mask_path``. Always 4-D, also for videos: one mask for every frame.
        original_sizes / crop_coords: per-sample ``(h, w)`` before resizing and the crop's top-left,
            for models with micro-conditioning (SDXL's time_ids).
    """

    pixels: torch.Tensor | None = None
    captions: list[str] | None = None
    masks: torch.Tensor | None = None
    original_sizes: list[tuple[int, int]] | None = None
    crop_coords: list[tuple[int, int]] | None = None


@dataclass
class TrainingContext:
    """Facts about the run that ``prepare_inputs`` may use.

    Attributes:
        model_config: the run's validated ``[model]`` table (an instance of the plugin's ``config_schema``).
        step: the 0-based optimizer step.
        eval_quantile: set while evaluating held-out data: use that quantile of the timestep distribution
            for every sample instead of sampling
            (``diffpipe_core.diffusion.sample_timesteps(..., quantile=context.eval_quantile)`` does it).
        extra: empty in this version: room for values a later core or a wrapper plugin adds without a
            contract change; don't rely on a key being present.
    """

    model_config: ModelConfigBase
    step: int = 0
    eval_quantile: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SampleRequest:
    """What to generate, handed to the denoising hooks (``denoise_init``, ``denoise_inputs``).

    Attributes:
        width / height: pixel size, a multiple of the model's ``spatial_multiple``.
        frames: frame count: 1 for images; ``frame_multiple * k + frame_offset`` for video models.
        steps: number of denoising steps; the schedule ``denoise_init`` returns has ``steps + 1`` entries.
        guidance: the value of a guidance-distilled model's guidance input (Flux dev), or None for the plugin's
            default. Classifier-free guidance (``[sample] cfg``) is done by the core and never reaches the plugin.
    """

    width: int
    height: int
    frames: int = 1
    steps: int = 20
    guidance: float | None = None


@dataclass(frozen=True)
class ParameterGroup:
    """A named share of the trainable parameters with its own learning rate (the ``parameter_groups`` hook).

    Attributes:
        name: the group's name (``"text_encoder_1"``), for messages.
        prefixes: parameter-name prefixes of the diffusion model (its ``named_parameters`` names, LoRA weights
            included) that belong to the group; a parameter goes to the first group with a matching prefix, and
            ``""`` matches every parameter.
        lr: the group's peak learning rate (the LR schedule scales it like ``[optimizer] lr``); None: ``[optimizer]
            lr``.
    """

    name: str
    prefixes: tuple[str, ...]
    lr: float | None = None
