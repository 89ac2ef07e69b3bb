"""The ``[model]`` table of a Lumina Image 2.0 run (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig

#: ``Lumina2Pipeline.system_prompt`` (diffusers 0.42.1), put before every caption as ``<system> <Prompt Start> caption``
SYSTEM_PROMPT = (
    "You are an assistant designed to generate superior images with the superior degree of image-text alignment "
    "based on textual prompts or user prompts."
)


class Lumina2Config(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of Lumina Image 2.0. ``path`` is a diffusers folder (``Lumina2Pipeline``: Gemma 2
    ``text_encoder``, Flux's ``vae``); ``diffusion_model`` a single file in the original layout
    (``layers.N.attention.qkv.weight``, as ComfyUI loads ``lumina_2_model_bf16.safetensors``)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("Alpha-VLLM/Lumina-Image-2.0",)

    text_max_length: int = Field(
        256,
        ge=1,
        le=512,
        description="Gemma tokens per caption, the system prompt included (Lumina2Pipeline's max_sequence_length, "
        "at most 512); the transformer sees only the real tokens (the attention mask is cached).",
    )
    system_prompt: str = Field(
        SYSTEM_PROMPT,
        description="Put before every caption as '<system_prompt> <Prompt Start> <caption>', as "
        "Lumina2Pipeline.encode_prompt does (its default is this one); a sample's negative prompt goes without it, "
        "as in the pipeline.",
    )
    lumina_shift: bool = Field(
        False,
        description="Shift the training times by the image's size as diffusion-pipe's lumina_shift: shift = e^mu, mu "
        "linear in the latent patch count (0.5 at 256 patches, 1.15 at 4096). Not with shift.",
    )
    cfg_normalization: bool = Field(
        True,
        description="Samples with cfg > 1: rescale the guided prediction to the norm of the conditional one, as "
        "Lumina2Pipeline's cfg_normalization (default on there too).",
    )
    cfg_trunc_ratio: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Samples with cfg > 1: guide only the first cfg_trunc_ratio of the steps, the rest use the "
        "conditional prediction alone (Lumina2Pipeline's cfg_trunc_ratio; 1 = every step).",
    )

    @model_validator(mode="after")
    def _one_shift(self) -> Lumina2Config:
        if self.lumina_shift and self.given("shift") and self.shift != 1.0:
            raise ValueError(f"[model] shift ({self.shift}) and lumina_shift = true exclude each other; set one")
        return self
