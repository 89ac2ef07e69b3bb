"""The ``[model]`` table of a Flux run (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

from pydantic import Field

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig


class FluxConfig(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of Flux (dev or schnell; which one is read from the transformer's config). ``path`` is a
    diffusers Flux folder; ``transformer_file`` a BFL single file (``flux1-dev.safetensors``)."""

    t5_max_length: int = Field(512, ge=1, le=512, description="T5 token count (captions are padded/truncated).")
    flux_shift: bool = Field(
        False,
        description="Use Flux's resolution-dependent shift (e^mu, mu linear in the image token count) instead of "
        "shift.",
    )
    guidance: float = Field(
        1.0, ge=0, description="Guidance value fed to guidance-distilled (dev) models; schnell has no guidance input."
    )
