"""The ``[model]`` table of a Flux run."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from diffpipe_core import ModelConfigBase

Dtype = Literal["float32", "bfloat16", "float16"]


class FluxConfig(ModelConfigBase):
    """``[model]`` keys of Flux (dev or schnell; which one is read from the transformer's config)."""

    path: Path = Field(
        description="A diffusers Flux folder (model_index.json, transformer/, vae/, text_encoder/, text_encoder_2/, "
        "tokenizer/, tokenizer_2/). With transformer_file, transformer/ needs only its config.json."
    )
    transformer_file: Path | None = Field(
        None,
        description="Optional single-file transformer checkpoint in the original BFL key layout "
        "(flux1-dev.safetensors); replaces the weights in path/transformer.",
    )
    dtype: Dtype = Field("bfloat16", description="dtype of the transformer's base weights while training.")
    encoder_dtype: Dtype = Field("bfloat16", description="dtype of the VAE and text encoders while caching.")
    t5_max_length: int = Field(512, ge=1, le=512, description="T5 token count (captions are padded/truncated).")
    timestep_sample_method: Literal["logit_normal", "uniform"] = Field(
        "logit_normal", description="How training times t in (0, 1) are drawn."
    )
    sigmoid_scale: float = Field(1.0, gt=0, description="logit_normal: t = sigmoid(sigmoid_scale * N(0, 1)).")
    shift: float = Field(1.0, gt=0, description="Time shift t' = shift*t / (1 + (shift-1)*t); ignored with flux_shift.")
    flux_shift: bool = Field(
        False, description="Use Flux's resolution-dependent shift (e^mu, mu linear in the image token count)."
    )
    guidance: float = Field(
        1.0, ge=0, description="Guidance value fed to guidance-distilled (dev) models; schnell has no guidance input."
    )
