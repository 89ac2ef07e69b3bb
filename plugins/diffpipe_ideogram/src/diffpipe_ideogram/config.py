"""The ``[model]`` table of Ideogram 4 runs (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig


class Ideogram4Config(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of Ideogram 4. ``path`` is a diffusers ``Ideogram4Pipeline`` folder (Qwen3-VL
    ``text_encoder``, FLUX.2's ``vae``, the conditional ``transformer`` trained here); ``diffusion_model`` the
    conditional transformer as one file, as ComfyUI loads it (``ideogram4_fp8_scaled.safetensors``: Ideogram's own
    names, fused ``attention.qkv``, under ``model.diffusion_model.``; or diffusers' names); fp8 scaled and int8 files
    stay quantized."""

    hub_repos: ClassVar[tuple[str, ...]] = ("ideogram-ai/ideogram-v4",)

    text_max_length: int = Field(
        256,
        ge=1,
        le=2048,
        description="Qwen3-VL tokens of a caption, its chat template included (the pipeline's max_sequence_length, "
        "at most its 2048). A longer caption is refused while caching, naming it, as the pipeline refuses it. Each "
        "cached token holds 13 tapped layers (13 x 4096 = 53248 values for Ideogram 4, 104 KiB in bfloat16), so a "
        "lower value keeps the cache smaller; the padding is masked.",
    )
    unconditional_model: Path | None = Field(
        None,
        description="The unconditional transformer as one file, as ComfyUI ships it "
        "(ideogram4_unconditional_fp8_scaled.safetensors; any layout diffusion_model takes, kept quantized). Read only "
        "for samples with [sample] cfg > 1, whose negative branch it runs as Ideogram4Pipeline does; without it, "
        "path/unconditional_transformer.",
    )
