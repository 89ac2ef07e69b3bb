"""The ``cosmos-predict2`` entry point: NVIDIA Cosmos-Predict2 (text-to-image and video), trained as rectified flow.

``hooks`` is the plugin object the entry point names; its hook methods live in :mod:`diffpipe_cosmos.hooks`.
No torch, diffusers or transformers import happens here.
"""

from __future__ import annotations

from diffpipe_core import ModelSpec
from diffpipe_cosmos.config import Predict2Config
from diffpipe_cosmos.hooks import CosmosHooks, Generation

SPEC = ModelSpec(
    name="cosmos-predict2",
    modality="video",
    config_schema=Predict2Config,
    spatial_multiple=16,
    frame_multiple=4,
    frame_offset=1,
    video_fps=16,
    encoder_settings=("path", "encoder_dtype", "t5_max_length"),
    block_layers=("BlockLayer",),
    adapter_formats=("diffusers", "comfyui"),
    model_formats=("diffusers", "single_file"),
    description="NVIDIA Cosmos-Predict2 text-to-image / video (diffusers folder or original single-file transformer)",
)

hooks = CosmosHooks(Generation(variant="predict2", spec=SPEC, default_fps=16.0))
