"""The ``[model]`` table of a Z-Image run (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig


class ZImageConfig(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of Z-Image (base or Turbo; which one is only a matter of the weights). ``path`` is a diffusers
    Z-Image folder (``ZImagePipeline``: Qwen3 ``text_encoder``, Flux-type ``vae``); ``diffusion_model`` a single
    file in the original layout (``layers.N.attention.qkv.weight``, as ComfyUI ships it)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("Tongyi-MAI/Z-Image-Turbo",)

    text_max_length: int = Field(
        512,
        ge=1,
        description="Qwen3 tokens of the chat-templated caption (ZImagePipeline's max_sequence_length); captions "
        "are padded/truncated to it, and the transformer sees only the real tokens.",
    )
    shift: float = Field(
        3.0,
        gt=0,
        description="Time shift t' = shift*t / (1 + (shift-1)*t); Z-Image's scheduler uses a fixed shift of 3.0 "
        "(scheduler/scheduler_config.json), which is the default here.",
    )
