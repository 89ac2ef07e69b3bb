"""The ``[model]`` table of an SDXL run."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, model_validator

from diffpipe_core import ModelConfigBase

Dtype = Literal["float32", "bfloat16", "float16"]


class SDXLConfig(ModelConfigBase):
    """``[model]`` keys of the SDXL plugin."""

    path: Path = Field(
        description="A diffusers SDXL folder (model_index.json, unet/, vae/, text_encoder/, text_encoder_2/, "
        "tokenizer/, tokenizer_2/) or a single-file .safetensors checkpoint in the original SGM/ComfyUI layout."
    )
    config_path: Path | None = Field(
        None,
        description="For a single-file `path`: a local diffusers SDXL folder that supplies the component configs "
        "and the tokenizers (its weights are not read). Nothing is fetched from the hub.",
    )
    vae_path: Path | None = Field(
        None,
        description="A diffusers AutoencoderKL folder to use instead of the checkpoint's VAE, e.g. the fp16-safe "
        "'sdxl-vae-fp16-fix'.",
    )
    dtype: Dtype = Field("bfloat16", description="dtype of the UNet's base weights while training.")
    vae_dtype: Dtype = Field(
        "float32",
        description="dtype the VAE encodes in. SDXL's original VAE overflows in float16: keep float32 (or bfloat16) "
        "unless `vae_path` is an fp16-safe VAE.",
    )
    text_encoder_dtype: Dtype = Field("float32", description="dtype the two CLIP text encoders run in while caching.")
    max_prompt_chunks: int = Field(
        3,
        ge=1,
        le=8,
        description="Prompts longer than 75 tokens are encoded in chunks of 75 (each wrapped in BOS/EOS, as A1111 and "
        "kohya do), at most this many; the text is cached as max_prompt_chunks * 77 tokens with a mask so that "
        "unused chunks are ignored by cross-attention. 1 truncates at 77 tokens like diffusers.",
    )
    v_pred: bool = Field(False, description="Train a v-prediction model (target v) instead of epsilon prediction.")
    zero_terminal_snr: bool = Field(
        False, description="Rescale the noise schedule to zero terminal SNR (Lin et al. 2023); use with v_pred."
    )
    min_snr_gamma: float | None = Field(
        None, gt=0, description="Min-SNR-gamma loss weighting (Hang et al. 2023), e.g. 5. Absent: off."
    )
    debiased_estimation: bool = Field(False, description="Weight the loss by 1/sqrt(SNR) (kohya's debiased estimation)")
    noise_offset: float = Field(0.0, ge=0, description="Add noise_offset * N(0, 1) per sample and channel to the noise")
    num_train_timesteps: int = Field(1000, ge=2, description="DDPM timesteps (SDXL: 1000).")
    beta_start: float = Field(0.00085, gt=0, description="First beta of the scaled-linear schedule (SDXL: 0.00085).")
    beta_end: float = Field(0.012, gt=0, description="Last beta of the scaled-linear schedule (SDXL: 0.012).")

    @model_validator(mode="after")
    def _single_file_needs_config(self, info: ValidationInfo) -> SDXLConfig:
        base = Path((info.context or {}).get("base_dir", "."))
        if (base / self.path).is_file() and self.config_path is None:
            raise ValueError(
                f"path {self.path} is a single-file checkpoint: set config_path to a local diffusers SDXL folder "
                "that holds the component configs and tokenizers (e.g. stabilityai/stable-diffusion-xl-base-1.0 "
                "downloaded without its weights)"
            )
        return self
