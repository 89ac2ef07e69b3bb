"""The ``[model]`` table of an OmniGen2 run (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig

#: ``OmniGen2Pipeline._apply_chat_template``'s system turn, before every caption (and the negative prompt)
SYSTEM_PROMPT = "You are a helpful assistant that generates high-quality images based on user instructions."


class OmniGen2Config(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of OmniGen2. ``path`` is the released folder (OmniGen2/OmniGen2: ``transformer/``, ``vae/``
    (FLUX.1's), ``mllm/`` (Qwen2.5-VL-3B), ``processor/``, ``scheduler/``); ``diffusion_model`` a single file
    (ComfyUI's ``omnigen2_fp16.safetensors``: the same names as the folder, under ``model.diffusion_model.`` or
    none), ``vae`` (``ae.safetensors``) and ``text_encoders`` (``qwen_2.5_vl_fp16.safetensors``)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("OmniGen2/OmniGen2",)

    text_max_length: int = Field(
        256,
        ge=1,
        le=1024,
        description="Qwen2.5-VL tokens per caption, the chat template included (the reference training's "
        "maximum_text_tokens; its pipeline does not truncate); the transformer sees only the real tokens (the "
        "attention mask is cached).",
    )
    system_prompt: str = Field(
        SYSTEM_PROMPT,
        description="The system turn of the chat template put around every caption, as OmniGen2Pipeline does (its "
        "text is this default); the negative prompt gets it too, as in the pipeline.",
    )
    flux_shift: bool = Field(
        True,
        description="Flux's resolution-dependent shift of the training times, as the reference training does (its "
        "dynamic_time_shift, on by default there): shift = e^mu, mu linear in the latent patch count (0.5 at 256 "
        "patches, 1.15 at 4096). Set false to use shift instead (diffusion-pipe's omnigen2 shifts only with "
        "flux_shift = true).",
    )

    @model_validator(mode="after")
    def _one_shift(self) -> OmniGen2Config:
        if self.flux_shift and self.given("shift") and self.shift != 1.0:
            raise ValueError(f"[model] shift ({self.shift}) needs flux_shift = false (the default shifts by the "
                             "image size, as OmniGen2's training)")
        return self
