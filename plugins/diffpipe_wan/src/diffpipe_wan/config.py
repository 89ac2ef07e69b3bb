"""The ``[model]`` tables of Wan runs (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig

DEFAULT_SHIFT = 5.0  # Wan's sample_shift for its 480p and 720p models when the folder's scheduler names none


class WanConfig(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of Wan. ``path`` is a diffusers Wan folder (``WanPipeline``: Wan 2.1 T2V 1.3B / 14B, Wan 2.2
    TI2V 5B, Wan 2.2 T2V A14B); ``diffusion_model`` a single file in the original Wan key layout
    (``blocks.0.self_attn.q.weight``, ..., as ComfyUI and the Wan repositories ship it) whose transformer replaces the
    folder's (the trained expert's, with ``expert``)."""

    hub_repos: ClassVar[tuple[str, ...]] = (
        "Wan-AI/Wan2.1-T2V-14B-Diffusers",
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    )

    text_max_length: int = Field(
        512,
        ge=1,
        le=512,
        description="UMT5 tokens per caption (padded with zeros after the caption's own tokens, as "
        "WanPipeline.encode_prompt does; its max_sequence_length default is 512). Fewer tokens train faster, but the "
        "transformer then sees fewer padding tokens than at inference.",
    )
    shift: float | None = Field(  # type: ignore[assignment]  (the shared field, with a file-derived default)
        None,
        gt=0,
        description="Time shift t' = shift*t / (1 + (shift-1)*t). Default: the folder's own scheduler's (flow_shift "
        "of UniPCMultistepScheduler, shift of FlowMatchEulerDiscreteScheduler), 5.0 when it names none.",
    )
    expert: Literal["high", "low", "both"] | None = Field(
        None,
        description="Wan 2.2 A14B (two transformers, switched at the pipeline's boundary_ratio): which one this run "
        "trains. 'both' (the default for an A14B folder) trains each on its own times: every sample's time t decides "
        "its expert, 'high' = transformer (the high-noise steps, t >= boundary_ratio), 'low' = transformer_2 "
        "(t < boundary_ratio), each with its own LoRA (or weights), optimizer state and learning rate (expert_lr). "
        "'high' or 'low' trains one, its training times limited to its range unless min_t / max_t are given. "
        "Refused for a folder with one transformer.",
    )
    diffusion_model_2: Path | None = Field(
        None,
        description="With expert = 'both' and diffusion_model (the high-noise transformer's file): the low-noise "
        "transformer_2's single file (ComfyUI's wan2.2_*_low_noise_14B_*), in the same layouts diffusion_model takes.",
    )
    expert_lr: dict[Literal["high", "low"], float] = Field(
        {},
        description="With expert = 'both': learning rates of the experts' parameter groups 'high' (transformer) and "
        "'low' (transformer_2), e.g. {low = 5e-5}; an expert left out trains at [optimizer] lr. The same as "
        "[optimizer] group_lr = {high = ..., low = ...}, which wins where both name a group.",
    )


class WanI2VConfig(WanConfig):
    """``[model]`` keys of Wan image-to-video (``WanImageToVideoPipeline`` folders: Wan 2.1 I2V 14B with its CLIP
    vision encoder, Wan 2.2 I2V A14B)."""

    hub_repos: ClassVar[tuple[str, ...]] = (
        "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
        "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers",
        "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
    )

    sample_image: Path | None = Field(
        None,
        description="The first frame every sample during training (and `diffpipe sample`) is generated from; "
        "required for [sample]. Resized to the sample size as WanImageToVideoPipeline does.",
    )


class WanControlConfig(WanConfig):
    """``[model]`` keys of the Wan models trained on control videos (``wan-fun``, and ``wan-vace``'s with its mask)."""

    sample_control: Path | None = Field(
        None,
        description="The control video every sample during training (and `diffpipe sample`) is generated from; "
        "required for [sample]. Its first frames at the model's frame rate, resized to cover the sample size and "
        "center-cropped, are encoded as in training.",
    )


class WanFunConfig(WanControlConfig):
    """``[model]`` keys of Wan Fun-Control (a ``WanPipeline`` folder whose transformer takes the control latents on
    its channels, or the Wan 2.1 T2V configs beside a Fun-Control single file in ``diffusion_model``)."""


class WanVACEConfig(WanControlConfig):
    """``[model]`` keys of Wan VACE (``WanVACEPipeline`` folders: Wan 2.1 VACE 1.3B / 14B)."""

    hub_repos: ClassVar[tuple[str, ...]] = (
        "Wan-AI/Wan2.1-VACE-1.3B-diffusers",
        "Wan-AI/Wan2.1-VACE-14B-diffusers",
    )

    sample_mask: Path | None = Field(
        None,
        description="A mask video for sample_control (white: generate, black: keep), read alike; default all white "
        "(WanVACEPipeline's default mask).",
    )
    sample_reference: Path | list[Path] | None = Field(
        None,
        description="A reference image (or a list of them) every sample is generated with, as WanVACEPipeline's "
        "reference_images: fitted on a white canvas of the sample size, one latent frame each in front of the video, "
        "dropped before decoding.",
    )
