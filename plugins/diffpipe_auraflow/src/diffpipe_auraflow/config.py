"""The ``[model]`` table of an AuraFlow run (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig


class AuraFlowConfig(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of AuraFlow (fal's v0.1-v0.3, and models of its architecture such as Pony V7). ``path`` is a
    diffusers folder (``AuraFlowPipeline``: UMT5 ``text_encoder``, SDXL's ``vae``); ``diffusion_model`` a single file in
    the original layout (``double_layers.N.attn.w2q.weight``, as ComfyUI loads ``pony-v7-base.safetensors``)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("fal/AuraFlow-v0.3", "fal/AuraFlow-v0.2", "fal/AuraFlow")

    text_max_length: int = Field(
        256,
        ge=1,
        le=1024,
        description="UMT5 tokens per caption (AuraFlowPipeline's max_sequence_length: 256 for fal's AuraFlow, 768 "
        "for Pony V7); padded or truncated, the padding zeroed as the pipeline does.",
    )
    shift: float = Field(
        1.73,
        gt=0,
        description="Time shift t' = shift*t / (1 + (shift-1)*t) of the training times; 1.73 is the shift of "
        "AuraFlow's scheduler (scheduler/scheduler_config.json), which samples use.",
    )
