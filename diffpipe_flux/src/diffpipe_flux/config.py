"""The ``[model]`` tables of the Flux family (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

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
    diffusers Flux folder; ``transformer_file`` a BFL single file (``flux1-dev.safetensors``)."""

    guidance: float = Field(
        1.0, ge=0, description="Guidance value fed to guidance-distilled (dev) models; schnell has no guidance input."
    )


class ChromaConfig(T5FluxConfig):
    """``[model]`` keys of Chroma. ``path`` is a diffusers ``ChromaPipeline`` folder; ``transformer_file`` one of
    Chroma's original checkpoints (``Chroma1-HD.safetensors``)."""


class Flux2Config(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of FLUX.2 [dev] and FLUX.2 [klein]. ``path`` is a diffusers ``Flux2Pipeline`` /
    ``Flux2KleinPipeline`` folder; ``transformer_file`` a BFL/ComfyUI single file (``flux2-dev.safetensors``)."""

    text_max_length: int = Field(
        512, ge=1, le=512, description="Text tokens, chat template included (padded/truncated, max_sequence_length)."
    )
    text_encoder_layers: tuple[int, ...] | None = Field(
        None,
        min_length=1,
        description="Hidden layers of the text encoder stacked into the text embedding (text_encoder_out_layers); "
        "default: the pipeline's ((10, 20, 30) for dev, (9, 18, 27) for klein).",
    )
    flux_shift: bool = Field(
        False,
        description="Use FLUX.2's resolution-dependent shift (e^mu of the pipeline's empirical mu at its default 50 "
        "steps) instead of shift.",
    )
    guidance: float = Field(
        1.0, ge=0, description="Guidance value fed to the guidance-distilled dev model; klein has no guidance input."
    )
