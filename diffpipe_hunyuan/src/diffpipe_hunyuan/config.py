"""The ``[model]`` table of a HunyuanVideo run (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig


class HunyuanConfig(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of HunyuanVideo (text-to-video; the guidance-distilled checkpoint). ``path`` is a diffusers
    HunyuanVideo folder (Llama ``text_encoder``, CLIP-L ``text_encoder_2``); ``diffusion_model`` a single file in the
    original Tencent key layout (``double_blocks.N.img_attn_qkv.weight``, ...)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("hunyuanvideo-community/HunyuanVideo",)

    text_max_length: int = Field(
        256, ge=1, description="Llama tokens kept after the prompt template is cut off (max_sequence_length)."
    )
    text_crop_start: int = Field(
        95,
        ge=0,
        description="Tokens of the prompt template before the caption, cut from the Llama output "
        "(the crop_start of diffusers' HunyuanVideo template: 95 for HunyuanVideo's Llama-3 tokenizer).",
    )
    vae_tiling: bool = Field(
        False, description="Encode large frames in overlapping spatial tiles (less memory; latents blend at seams)."
    )
    vae_tile_size: int = Field(
        256, ge=64, multiple_of=32, description="vae_tiling: tile height and width in pixels (a multiple of 32)."
    )
    vae_tile_frames: int = Field(
        16,
        ge=4,
        multiple_of=4,
        description="Clips longer than this many frames (a multiple of 4) are encoded in overlapping temporal chunks.",
    )
    vae_slicing: bool = Field(False, description="Encode one sample of a batch at a time (less memory, same latents).")
    guidance: float = Field(
        1.0, ge=0, description="Guidance-embedding value fed to the guidance-distilled transformer while training."
    )


class HunyuanVideo15Config(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of HunyuanVideo-1.5 text-to-video. ``path`` is a diffusers ``HunyuanVideo15Pipeline`` folder
    (Qwen2.5-VL ``text_encoder``, glyph ByT5 ``text_encoder_2``); ``diffusion_model`` a single file in Tencent's
    key layout (``double_blocks.N.img_attn_q.weight``, ...)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v",)

    text_max_length: int = Field(
        1000, ge=1, description="Qwen2.5-VL tokens kept after the prompt template is cut off (the pipeline's 1000)."
    )
    text_crop_start: int = Field(
        108,
        ge=0,
        description="Tokens of the chat template (system message and user header) before the caption, cut from the "
        "Qwen2.5-VL output (the pipeline's prompt_template_encode_start_idx: 108 for Qwen2.5-VL's tokenizer).",
    )
    glyph_max_length: int = Field(
        256,
        ge=1,
        description="ByT5 tokens of the quoted text of a caption (\"...\"), the glyph embedding (the pipeline's 256); "
        "captions without quotes get an all-masked glyph embedding.",
    )
    vae_tiling: bool = Field(False, description="Encode large frames in overlapping spatial tiles (less memory).")


class HunyuanVideo15I2VConfig(HunyuanVideo15Config):
    """``[model]`` keys of HunyuanVideo-1.5 image-to-video (``HunyuanVideo15ImageToVideoPipeline`` folders, with the
    SigLIP ``image_encoder`` and its ``feature_extractor``)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v",)

    sample_image: Path | None = Field(
        None,
        description="The first frame every sample during training (and `diffpipe sample`) is generated from; "
        "required for [sample]. Resized and center-cropped to the sample size as the pipeline does.",
    )


class HunyuanImage21Config(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of HunyuanImage-2.1 (the base checkpoint, or the guidance-distilled MeanFlow one: the
    transformer's config says which). ``path`` is a diffusers ``HunyuanImagePipeline`` folder (Qwen2.5-VL
    ``text_encoder``, glyph ByT5 ``text_encoder_2``, the 32x ``vae``); ``diffusion_model`` a single file in Tencent's
    key layout (``hunyuanimage2.1.safetensors``: ``double_blocks.N.img_attn_qkv.weight``, ...) or ComfyUI's names;
    fp8 scaled and int8 files stay quantized."""

    hub_repos: ClassVar[tuple[str, ...]] = (
        "hunyuanvideo-community/HunyuanImage-2.1-Diffusers",
        "hunyuanvideo-community/HunyuanImage-2.1-Distilled-Diffusers",
    )

    text_max_length: int = Field(
        1000,
        ge=1,
        le=4096,
        description="Qwen2.5-VL tokens of a caption kept after the template's 34 system tokens (the pipeline's "
        "tokenizer_max_length, 1000); longer captions are truncated as the pipeline truncates them. The padding is "
        "masked, so a lower value changes nothing for captions that fit and keeps the cache smaller.",
    )
    glyph_max_length: int = Field(
        128,
        ge=1,
        le=1024,
        description="ByT5 tokens of a caption's quoted text ('...', \"...\", ‘...’, “...”), the glyph embedding (the "
        "pipeline's tokenizer_2_max_length, 128); captions without quotes get an all-masked glyph embedding.",
    )
    guidance: float = Field(
        3.25,
        ge=0,
        description="The guidance-distilled checkpoint only: the guidance-embedding value while training and the "
        "default of samples (the pipeline's distilled_guidance_scale, 3.25); the base checkpoint has no such input.",
    )
