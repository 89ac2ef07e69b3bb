"""Model specs for data-pipeline tests that need a model's geometry but no model."""

from __future__ import annotations

from diffpipe_core.types import ModelConfigBase, ModelSpec

TINY_VIDEO_SPEC = ModelSpec(
    name="tinyvideo",
    modality="video",
    config_schema=ModelConfigBase,
    spatial_multiple=16,
    frame_multiple=4,
    frame_offset=1,
    video_fps=8,
)
"""A video model: sizes in multiples of 16, frame counts 4k + 1, resampled to 8 fps."""
