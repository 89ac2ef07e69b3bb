"""The ``[model]`` table of {{name}}: the keys every diffusers-backed flow model
shares, then its own.

Imports pydantic only: ``diffpipe models`` and ``validate`` read it.
"""

from __future__ import annotations

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig
from pydantic import Field


class ModelConfig(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of {{name}}:
    ``path``, ``dtype``, ``encoder_dtype``, the flow-matching time options (``timestep_sample_method``, ``shift``,
    ``min_t``/``max_t``, ...) and the model's own below."""

    text_max_length: int = Field(16, ge=1, le=512, description="T5 tokens per caption (padded or truncated).")
