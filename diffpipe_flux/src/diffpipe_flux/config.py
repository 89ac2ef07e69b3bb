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


class Flux3Config(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of FLUX.3 (``flux-3-image-klein-base``). ``path`` is a diffusers FLUX.3 folder (the modular
    pipeline's components: ``transformer``, ``vae``, ``text_encoder`` (Qwen3-VL), ``tokenizer`` (its processor),
    ``scheduler``); ``diffusion_model`` a single-file transformer in BFL's names
    (``flux-3-image-klein-base.safetensors``) or diffusers' names (fp8 scaled and int8 files kept quantized)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("black-forest-labs/flux-3-image-klein-base",)

    text_max_length: int = Field(
        512,
        ge=1,
        le=8192,
        description="The modular pipeline's max_sequence_length: Qwen3-VL tokens of a chat-templated caption kept "
        "(longer captions are truncated). Each caption's text window is its token count rounded up to a multiple of "
        "80 (capped here), as the pipeline pads it; the transformer attends to that padding, so the window is cached "
        "with it and a micro-batch of mixed windows masks each caption's extra keys.",
    )
    scheduler_shift: bool = Field(
        True,
        description="Shift the training times by the pipeline scheduler's constant shift (FLUX.3's 6.93, or the "
        "folder's scheduler config), as the pipeline shifts its sigmas; false: the shift key.",
    )


class Flux3DistilledConfig(Flux3Config):
    """``[model]`` keys of the step-distilled FLUX.3 (``flux-3-image-klein``, a flow map: 16 steps, no guidance).
    Trained at its flow map's diagonal (the step's target time = its time); ``cfg`` (CFG-augmented training) keeps
    the guidance it was distilled with."""

    hub_repos: ClassVar[tuple[str, ...]] = ("black-forest-labs/flux-3-image-klein",)
