"""The ``cosmos`` entry point: NVIDIA Cosmos-1.0 Diffusion text-to-world, trained with its EDM objective.

``hooks`` is the plugin object the entry point names; its hook methods live in :mod:`diffpipe_cosmos.hooks`.
No torch, diffusers or transformers import happens here.
"""

from __future__ import annotations

from diffpipe_core import ModelSpec
from diffpipe_cosmos.config import Cosmos1Config
from diffpipe_cosmos.hooks import CosmosHooks, Generation

SPEC = ModelSpec(
    name="cosmos",
    modality="video",
    config_schema=Cosmos1Config,
    spatial_multiple=16,
    frame_multiple=8,
    frame_offset=1,
    video_fps=30,
    encoder_settings=("path", "encoder_dtype", "t5_max_length", "sigma_data"),
    block_layers=("BlockLayer",),
    adapter_formats=("diffusers", "comfyui"),
    model_formats=("diffusers", "single_file"),
    description="NVIDIA Cosmos-1.0 Diffusion text-to-world (diffusers folder or original single-file transformer)",
)

hooks = CosmosHooks(Generation(variant="1.0", spec=SPEC, default_fps=30.0))
