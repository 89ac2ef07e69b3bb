"""The ``[model]`` table of an LTX-Video run (pydantic and stdlib only: imported before torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from diffpipe_core import ModelConfigBase

Dtype = Literal["float32", "bfloat16", "float16"]


class LTXConfig(ModelConfigBase):
    """``[model]`` keys of LTX-Video."""

    path: Path = Field(
        description="A diffusers LTX-Video folder (model_index.json, transformer/, vae/, text_encoder/, tokenizer/, "
        "scheduler/). With transformer_file, transformer/ needs only its config.json."
    )
    transformer_file: Path | None = Field(
        None,
        description="Optional single-file checkpoint in the original Lightricks key layout "
        "(ltx-video-2b-v0.9.safetensors: model.diffusion_model.patchify_proj.weight, ...); its transformer replaces "
        "the weights in path/transformer, everything else (VAE, T5) comes from path.",
    )
    dtype: Dtype = Field("bfloat16", description="dtype of the transformer's base weights while training.")
    encoder_dtype: Dtype = Field("bfloat16", description="dtype of the VAE and T5 encoder while caching.")
    t5_max_length: int = Field(
        128, ge=1, le=512, description="T5 tokens (padded/truncated; LTXPipeline's max_sequence_length default)."
    )
    timestep_sample_method: Literal["logit_normal", "uniform"] = Field(
        "logit_normal", description="How training times t in (0, 1) are drawn."
    )
    sigmoid_scale: float = Field(1.0, gt=0, description="logit_normal: t = sigmoid(sigmoid_scale * N(0, 1)).")
    shift: float = Field(
        1.0, gt=0, description="Time shift t' = shift*t / (1 + (shift-1)*t); ignored with resolution_shift."
    )
    resolution_shift: bool = Field(
        False,
        description="LTXPipeline's sequence-length-dependent shift: e^mu, mu linear in the latent token count "
        "(frames x height x width) with the constants of path/scheduler/scheduler_config.json.",
    )
    first_frame_conditioning_p: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Probability that a video's first latent frame stays clean (timestep 0) and is left out of the "
        "loss: trains image-to-video. Images (one latent frame) are never conditioned.",
    )
