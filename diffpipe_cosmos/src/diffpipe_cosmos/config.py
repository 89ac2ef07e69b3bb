"""The ``[model]`` tables of the two Cosmos entry points (pydantic and stdlib only: read before torch loads)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from diffpipe_core import ModelConfigBase

Dtype = Literal["float32", "bfloat16", "float16"]


class CosmosConfigBase(ModelConfigBase):
    """``[model]`` keys common to Cosmos-1.0 and Cosmos-Predict2."""

    path: Path = Field(
        description="A diffusers Cosmos folder (model_index.json, transformer/, vae/, text_encoder/, tokenizer/). "
        "With transformer_file, transformer/ needs only its config.json."
    )
    transformer_file: Path | None = Field(
        None,
        description="Optional single-file transformer checkpoint in NVIDIA's original key layout (net.blocks...); "
        "replaces the weights in path/transformer.",
    )
    dtype: Dtype = Field("bfloat16", description="dtype of the transformer's base weights while training.")
    encoder_dtype: Dtype = Field("bfloat16", description="dtype of the VAE and T5 encoder while caching.")
    t5_max_length: int = Field(
        512, ge=1, le=512, description="T5 token count; captions are padded (zero embeddings) or truncated to it."
    )
    fps: float | None = Field(
        None,
        gt=0,
        description="Frame rate given to the transformer's rotary embedding for videos (None: the model default "
        "of the entry point). Images (1 latent frame) get none, as in the text-to-image pipelines.",
    )


class Cosmos1Config(CosmosConfigBase):
    """``[model]`` keys of Cosmos-1.0 Diffusion text-to-world (EDM training)."""

    sigma_data: float = Field(0.5, gt=0, description="EDM sigma_data (the Cosmos-1.0 scheduler's).")
    p_mean: float = Field(0.0, description="Training noise levels: log sigma ~ N(p_mean, p_std).")
    p_std: float = Field(1.0, gt=0, description="Training noise levels: log sigma ~ N(p_mean, p_std).")


class Predict2Config(CosmosConfigBase):
    """``[model]`` keys of Cosmos-Predict2 (text-to-image and video; rectified-flow training)."""

    timestep_sample_method: Literal["logit_normal", "uniform"] = Field(
        "logit_normal",
        description="How t in (0, 1) is drawn. logit_normal with shift s is log sigma ~ N(log s, sigmoid_scale) "
        "in NVIDIA's sigma = t / (1 - t).",
    )
    sigmoid_scale: float = Field(1.0, gt=0, description="logit_normal: t = sigmoid(sigmoid_scale * N(0, 1)).")
    shift: float = Field(1.0, gt=0, description="Time shift t' = shift*t / (1 + (shift-1)*t).")
    nvidia_weighting: bool = Field(
        False,
        description="Weight each sample's velocity loss by t^2 + (1-t)^2: NVIDIA's EDM loss weight (sigma_data 1) "
        "rewritten in t. Off: the plain rectified-flow MSE.",
    )
