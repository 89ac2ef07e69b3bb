"""Plain data types that cross the plugin boundary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict


class ModelConfigBase(BaseModel):
    """Base class for a plugin's ``[model]`` schema.

    Subclass it, declare fields with types, defaults and ``Field(description=...)``; unknown keys are
    rejected with a close spelling, and every field appears in ``diffpipe config-reference``.
    ``type`` (the model name) and ``dtype`` are common to every model.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"


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
    description: str = ""


@dataclass
class EncodeBatch:
    """One batch handed to ``encode_batch`` while caching.

    The core encodes media and captions in separate calls so that each is cached (and invalidated)
    on its own: a media batch has ``pixels`` set and ``captions`` None, a caption batch the reverse.

    Attributes:
        pixels: ``(B, C, H, W)`` for images or ``(B, C, F, H, W)`` for videos, float in [-1, 1].
        captions: the caption strings.
        masks: optional ``(B, 1, H, W)`` loss masks in [0, 1], same size as ``pixels``.
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

    ``step`` is the 0-based optimizer step. ``eval_quantile`` is set while evaluating held-out data:
    use that quantile of the timestep distribution for every sample instead of sampling
    (``diffpipe_core.diffusion.sample_timesteps(..., quantile=context.eval_quantile)`` does it).
    """

    model_config: ModelConfigBase
    step: int = 0
    eval_quantile: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
