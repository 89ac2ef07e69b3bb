"""The ``[model]`` table of an SDXL run (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationInfo, model_validator

from diffpipe_core.parts.config import DDPMConfig, Dtype


class SDXLConfig(DDPMConfig):
    """``[model]`` keys of the SDXL plugin (the DDPM objective's are :class:`~diffpipe_core.parts.config.DDPMConfig`'s).
    ``path`` is a diffusers folder or an SGM single file."""

    path: Path = Field(
        description="A diffusers SDXL folder (model_index.json, unet/, vae/, text_encoder/, text_encoder_2/, "
        "tokenizer/, tokenizer_2/) or a single-file .safetensors checkpoint in the original SGM/ComfyUI layout "
        "(then set config_path)."
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
    train_text_encoders: bool = Field(
        False,
        description="Train both CLIP text encoders with the UNet (LoRA or full fine-tuning, as the run trains the "
        "UNet): captions are cached as token ids and the encoders run in the first pipeline stage. Their learning "
        "rates: [optimizer] group_lr = {text_encoder_1 = ..., text_encoder_2 = ..., unet = ...}.",
    )

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
