"""The ``[model]`` table of a HunyuanVideo run (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from diffpipe_core import ModelConfigBase

Dtype = Literal["float32", "bfloat16", "float16"]


class HunyuanConfig(ModelConfigBase):
    """``[model]`` keys of HunyuanVideo (text-to-video; the guidance-distilled checkpoint)."""

    path: Path = Field(
        description="A diffusers HunyuanVideo folder (model_index.json, transformer/, vae/, text_encoder/ (Llama), "
        "tokenizer/, text_encoder_2/ (CLIP-L), tokenizer_2/). With transformer_file, transformer/ needs only its "
        "config.json."
    )
    transformer_file: Path | None = Field(
        None,
        description="Optional single-file transformer in the original Tencent key layout "
        "(double_blocks.N.img_attn_qkv.weight, ...); replaces the weights in path/transformer.",
    )
    dtype: Dtype = Field("bfloat16", description="dtype of the transformer's base weights while training.")
    encoder_dtype: Dtype = Field("bfloat16", description="dtype of the VAE and text encoders while caching.")
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
    timestep_sample_method: Literal["logit_normal", "uniform"] = Field(
        "logit_normal", description="How training times t in (0, 1) are drawn."
    )
    sigmoid_scale: float = Field(1.0, gt=0, description="logit_normal: t = sigmoid(sigmoid_scale * N(0, 1)).")
    shift: float = Field(1.0, gt=0, description="Time shift t' = shift*t / (1 + (shift-1)*t).")
    guidance: float = Field(
        1.0, ge=0, description="Guidance-embedding value fed to the guidance-distilled transformer while training."
    )
