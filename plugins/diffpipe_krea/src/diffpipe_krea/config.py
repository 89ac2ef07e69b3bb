"""The ``[model]`` tables of Krea 2 runs (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig


class Krea2Config(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of Krea 2. ``path`` is a diffusers ``Krea2Pipeline`` folder (Qwen3-VL ``text_encoder``,
    Qwen-Image's ``vae``); ``diffusion_model`` a single-file transformer as ComfyUI loads it (``krea2_raw.safetensors``:
    Krea's own names, ``blocks.N.attn.wq``, optionally under ``model.diffusion_model.``; or diffusers' names); fp8
    scaled and int8 files stay quantized."""

    hub_repos: ClassVar[tuple[str, ...]] = ("krea/Krea-2-Raw",)

    text_max_length: int = Field(
        512,
        ge=1,
        le=4096,
        description="Qwen3-VL tokens of a caption kept after the system turn the pipeline drops (the pipeline's "
        "max_sequence_length, its template's closing turn included); longer captions are truncated as the pipeline "
        "truncates them. Each cached token holds every tapped layer (12 x 2560 values for Krea 2), so a lower value "
        "keeps the cache smaller; the padding is not stored as text (it is masked).",
    )
    dynamic_shift: bool = Field(
        True,
        description="Shift the training times as the pipeline shifts its sigmas: e^mu, mu = calculate_shift of the "
        "image's token count with the folder's scheduler config (the distilled checkpoint's fixed mu = 1.15); "
        "false: the fixed shift.",
    )
    lora_text_layers: bool = Field(
        True,
        description="The default LoRA targets include the text layers (text_fusion's blocks and projector, txt_in's "
        "linears), as diffusion-pipe trains Krea 2; false: the transformer blocks' linears only.",
    )


class Krea2TurboConfig(Krea2Config):
    """``[model]`` keys of Krea 2 Turbo: ``path`` is a Krea 2 folder (the Turbo checkpoint's, or Raw's configs under a
    Turbo ``diffusion_model`` file); samples use the distilled schedule (mu = 1.15) without guidance."""

    hub_repos: ClassVar[tuple[str, ...]] = ("krea/Krea-2-Turbo", "krea/Krea-2-Raw")
