"""The ``[model]`` table of an ERNIE-Image run (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig


class ErnieImageConfig(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of ERNIE-Image (base or Turbo; which one is only a matter of the weights). ``path`` is a
    diffusers ``ErnieImagePipeline`` folder (Ministral 3 ``text_encoder``, FLUX.2's ``vae``); ``diffusion_model`` the
    transformer as one file, as ComfyUI ships it (diffusers' module names, optionally under
    ``model.diffusion_model.``)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("baidu/ERNIE-Image", "baidu/ERNIE-Image-Turbo")

    text_max_length: int = Field(
        256,
        ge=1,
        description="Ministral 3 tokens of a caption (BOS included) kept in the cache; "
        "ErnieImagePipeline.encode_prompt takes every token, so a longer caption is refused while caching, naming it. "
        "The padding is masked.",
    )
    shift: float = Field(
        3.0,
        gt=0,
        description="Time shift t' = shift*t / (1 + (shift-1)*t) of the training times; 3.0 is diffusion-pipe's value "
        "for ERNIE-Image (its supported-models example). Samples use the folder's own scheduler, whatever this says.",
    )
