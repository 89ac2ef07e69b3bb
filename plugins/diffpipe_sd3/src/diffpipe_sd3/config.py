"""The ``[model]`` table of a Stable Diffusion 3 / 3.5 run (pydantic and the standard library only: imported at
start-up)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig


class SD3Config(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of SD3 Medium, SD3.5 Medium, Large and Large Turbo (which one is a matter of the weights and
    the transformer's config). ``path`` is a diffusers folder (``StableDiffusion3Pipeline``: CLIP-L ``text_encoder``,
    CLIP-G ``text_encoder_2``, T5 ``text_encoder_3``, a 16-channel ``vae``); ``diffusion_model`` a single file in
    Stability's MMDiT layout (``joint_blocks.N.x_block.attn.qkv.weight``, as ``sd3.5_large.safetensors`` holds it)."""

    hub_repos: ClassVar[tuple[str, ...]] = (
        "stabilityai/stable-diffusion-3.5-large",
        "stabilityai/stable-diffusion-3.5-medium",
        "stabilityai/stable-diffusion-3.5-large-turbo",
        "stabilityai/stable-diffusion-3-medium-diffusers",
    )

    text_max_length: int = Field(
        256,
        ge=1,
        le=512,
        description="T5 tokens per caption (StableDiffusion3Pipeline's max_sequence_length, default 256); the "
        "transformer sees CLIP's 77 tokens followed by these.",
    )
    t5: bool = Field(
        True,
        description="Encode captions with T5 (text_encoder_3). false: T5 is never loaded and its tokens are zeros, "
        "as StableDiffusion3Pipeline computes them with text_encoder_3=None (train and sample alike).",
    )
    shift: float = Field(
        3.0,
        gt=0,
        description="Time shift t' = shift*t / (1 + (shift-1)*t) of the training times; 3.0 is the shift of SD3's "
        "and SD3.5's scheduler (scheduler/scheduler_config.json), which samples use.",
    )
