"""The ``[model]`` table of {{name}}.

Imports pydantic only: ``diffpipe models`` and ``validate`` read it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from diffpipe_core import ModelConfigBase
from pydantic import Field


class ModelConfig(ModelConfigBase):
    """``[model]`` keys of {{name}}."""

    path: Path = Field(description="Model folder (config.json and three safetensors files).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Base weight dtype.")
    timestep_sample_method: Literal["logit_normal", "uniform"] = Field(
        "logit_normal", description="How training times t in (0, 1) are drawn."
    )
    sigmoid_scale: float = Field(1.0, gt=0, description="Scale of the logit-normal time distribution.")
    shift: float = Field(1.0, gt=0, description="Time shift applied after sampling (1 = none).")
