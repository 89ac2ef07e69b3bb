"""The ``[model]`` tables of Qwen-Image and Qwen-Image-Edit runs (pydantic and the standard library only: imported
at start-up)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig


class QwenImageConfig(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of Qwen-Image. ``path`` is a diffusers ``QwenImagePipeline`` folder; ``diffusion_model`` a
    single-file transformer as ComfyUI ships it (``qwen_image_bf16.safetensors``: diffusers names, optionally under
    ``model.diffusion_model.``)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("Qwen/Qwen-Image",)

    text_max_length: int = Field(
        512,
        ge=1,
        le=1024,
        description="Qwen2.5-VL tokens of a caption kept after the prompt template's prefix (the pipeline's "
        "max_sequence_length); shorter embeddings are padded to it in the cache and the padding is masked.",
    )
    dynamic_shift: bool = Field(
        True,
        description="Shift the training times as the pipeline's scheduler shifts its sigmas for the image's token "
        "count (e^mu, mu = calculate_shift with the folder's scheduler config); false: the fixed shift.",
    )


class QwenImageEditConfig(QwenImageConfig):
    """``[model]`` keys of Qwen-Image-Edit: ``path`` is a diffusers ``QwenImageEditPipeline`` (Qwen-Image-Edit) or
    ``QwenImageEditPlusPipeline`` (Qwen-Image-Edit-2509, up to three reference images) folder."""

    hub_repos: ClassVar[tuple[str, ...]] = ("Qwen/Qwen-Image-Edit-2509", "Qwen/Qwen-Image-Edit")

    text_max_length: int = Field(
        1536,
        ge=1,
        le=16384,
        description="Tokens of an instruction's embedding after the template's prefix, the reference images' "
        "vision tokens included (about area / 784 per image: ~1340 at Qwen-Image-Edit's 1024x1024, ~200 at "
        "2509's 384x384); shorter embeddings are padded and masked, longer ones cut (with a warning).",
    )
    vl_image_area: int | None = Field(
        None,
        ge=784,
        description="Pixel area the reference images are resized to (aspect kept, sides rounded to 32) before "
        "Qwen2.5-VL sees them. Default: the pipeline's, 1024*1024 for QwenImageEditPipeline, 384*384 for "
        "QwenImageEditPlusPipeline.",
    )


class QwenImage21Config(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of Qwen-Image 2.1. ``path`` is a diffusers ``QwenImage21Pipeline`` folder; ``diffusion_model``
    a single-file transformer as ComfyUI loads it (``qwen_image_2.1_bf16.safetensors``: diffusers names, optionally
    under ``model.diffusion_model.``; fp8 scaled and int8 files stay quantized)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("Qwen/Qwen-Image-2.1",)

    text_max_length: int = Field(
        512,
        ge=1,
        le=8192,
        description="Qwen3-VL tokens of a caption kept after the system turn the pipeline drops; shorter embeddings "
        "are padded to it in the cache and the padding is masked, longer ones cut (with a warning).",
    )
    dynamic_shift: bool = Field(
        True,
        description="Shift the training times as the pipeline's scheduler shifts its sigmas for the image's token "
        "count (mu = calculate_shift with the folder's scheduler config); false: the fixed shift.",
    )


class QwenImage21TurboConfig(QwenImage21Config):
    """``[model]`` keys of Qwen-Image 2.1 Turbo: ``path`` is the Turbo checkpoint's ``QwenImage21Pipeline`` folder
    (its ``model_index.json`` carries the few-step ``sample_sigmas``)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("Qwen/Qwen-Image-2.1-Turbo",)
