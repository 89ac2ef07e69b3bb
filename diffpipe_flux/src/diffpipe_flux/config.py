"""The ``[model]`` tables of the Flux family (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig


class T5FluxConfig(DiffusersModelConfig, FlowMatchingConfig):
    """Keys of the T5-conditioned members (Flux.1, Chroma)."""

    t5_max_length: int = Field(512, ge=1, le=512, description="T5 token count (captions are padded/truncated).")
    flux_shift: bool = Field(
        False,
        description="Use Flux's resolution-dependent shift (e^mu, mu linear in the image token count) instead of "
        "shift.",
    )


class FluxConfig(T5FluxConfig):
    """``[model]`` keys of Flux (dev or schnell; which one is read from the transformer's config). ``path`` is a
    diffusers Flux folder; ``diffusion_model`` a BFL single file (``flux1-dev.safetensors``)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("black-forest-labs/FLUX.1-dev", "black-forest-labs/FLUX.1-schnell")

    guidance: float = Field(
        1.0, ge=0, description="Guidance value fed to guidance-distilled (dev) models; schnell has no guidance input."
    )


class FluxKontextConfig(FluxConfig):
    """``[model]`` keys of FLUX.1 Kontext [dev] (Flux's). ``path`` is a diffusers ``FluxKontextPipeline`` folder;
    ``diffusion_model`` the BFL single file (``flux1-kontext-dev.safetensors``)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("black-forest-labs/FLUX.1-Kontext-dev",)


class ChromaConfig(T5FluxConfig):
    """``[model]`` keys of Chroma. ``path`` is a diffusers ``ChromaPipeline`` folder; ``diffusion_model`` one of
    Chroma's original checkpoints (``Chroma1-HD.safetensors``)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("lodestones/Chroma1-HD",)


class Flux2KleinConfig(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of FLUX.2 [klein]. ``path`` is a diffusers ``Flux2KleinPipeline`` folder; ``diffusion_model``
    a single file in the BFL / ComfyUI layout (``flux-2-klein-4b.safetensors``)."""

    hub_repos: ClassVar[tuple[str, ...]] = (
        "black-forest-labs/FLUX.2-klein-4B", "black-forest-labs/FLUX.2-klein-9B",
        "black-forest-labs/FLUX.2-klein-base-4B", "black-forest-labs/FLUX.2-klein-base-9B",
    )

    text_max_length: int = Field(
        512, ge=1, le=512, description="Text tokens (the chat-templated caption padded/truncated to it), as "
        "the pipeline's max_sequence_length."
    )


class Flux2Config(Flux2KleinConfig):
    """``[model]`` keys of FLUX.2 [dev]. ``path`` is a diffusers ``Flux2Pipeline`` folder; ``diffusion_model`` a
    single file in the BFL / ComfyUI layout (``flux2_dev.safetensors``)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("black-forest-labs/FLUX.2-dev",)

    guidance: float = Field(1.0, ge=0, description="Guidance value fed to the guidance-distilled transformer.")
