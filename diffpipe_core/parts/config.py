"""``[model]`` keys every diffusers-backed model shares, declared once so each plugin's schema lists only its own.

    class FluxConfig(DiffusersModelConfig, FlowMatchingConfig):
        t5_max_length: int = Field(512, ge=1, le=512, description="T5 token count.")

Field order in ``diffpipe config-reference`` follows the classes: shared keys first, then the model's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from diffpipe_core.types import ModelConfigBase

Dtype = Literal["float32", "bfloat16", "float16"]


class TextEncoderFile(BaseModel):
    """One text encoder file of ``[model] text_encoders``: ``{path, type}`` as diffusion-pipe writes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path = Field(description="The text encoder's single file (safetensors).")
    type: str | None = Field(
        None, description="ComfyUI's name for the encoder's kind (clip_l, t5, qwen_image, ...); informational: "
        "diffpipe reads which of the model's text encoders a file holds from its tensors."
    )


class DiffusersModelConfig(ModelConfigBase):
    """A model read from a diffusers folder, from component files (as ComfyUI keeps them), or from both."""

    #: Hugging Face repositories whose cached snapshot serves as ``path`` when the table gives none (configs,
    #: tokenizers and the scheduler, read from the user's cache; weights are never downloaded).
    hub_repos: ClassVar[tuple[str, ...]] = ()

    path: Path | None = Field(
        None,
        validate_default=True,
        description="The model's diffusers folder (model_index.json and its component folders, as "
        "`save_pretrained` writes them; the components are listed by `diffpipe validate`). A component given as a "
        "file below needs only its config (and tokenizer) files here. Absent: the snapshot of the model's published "
        "repository in the Hugging Face cache, if there is one (configs and tokenizers only are read).",
    )
    diffusion_model: Path | None = Field(
        None,
        description="The diffusion model (transformer) as one file, as the model's authors or ComfyUI ship it: in "
        "diffusers', the original release's or ComfyUI's key names, in any float dtype or quantized (ComfyUI's fp8 "
        "scaled and int8 files stay quantized; LoRA only). Replaces the weights in path/transformer, whose "
        "config.json sizes it. transformer_file is the older name of this key.",
    )
    vae: Path | None = Field(
        None,
        description="The VAE as one file (diffusers', the original or ComfyUI's key names); replaces path/vae's "
        "weights.",
    )
    text_encoders: tuple[Path | TextEncoderFile, ...] = Field(
        (),
        description="Text encoder files (paths, or {path, type} tables as diffusion-pipe writes them), in "
        "transformers', the original or ComfyUI's key names, fp8 scaled ones too. Which of the model's text "
        "encoders each holds is read from its tensors; each replaces that component's weights in path. An "
        "image-to-video model's image encoder file (ComfyUI's clip_vision_h.safetensors) is listed here too.",
    )
    audio_vae: Path | None = Field(
        None, description="The audio VAE as one file, for a model that has one; replaces path/audio_vae's weights."
    )
    dtype: Dtype = Field("bfloat16", description="dtype of the diffusion model's base weights while training.")
    encoder_dtype: Dtype = Field("bfloat16", description="dtype of the VAE and text encoders while caching.")
    encoder_quantize: Literal["nf4", "int8"] | None = Field(
        None,
        description="Load the text encoders quantized while caching (bitsandbytes 'nf4' computing in encoder_dtype, "
        "or 'int8'), tensor by tensor as they are read, so a large one (an LLM) is never whole in memory in full "
        "precision: about a quarter ('nf4') or half ('int8') of its bf16 size. The cached text differs slightly from "
        "the unquantized encoder's (the cache is rebuilt when this changes). Quantizes the folder's text encoders; "
        "not with a text encoder given as a file in text_encoders. Needs the bitsandbytes package.",
    )

    @model_validator(mode="before")
    @classmethod
    def _older_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and "transformer_file" in data:
            data = dict(data)
            if "diffusion_model" in data:
                raise ValueError("give diffusion_model or transformer_file (its older name), not both")
            data["diffusion_model"] = data.pop("transformer_file")
        return data

    @field_validator("path", mode="after")
    @classmethod
    def _config_folder(cls, value: Path | None, info: ValidationInfo) -> Path:
        """Without a folder, the Hugging Face cache's snapshot of the model (ValueError saying what to give when
        there is none)."""
        if value is not None:
            return value
        from diffpipe_core.component_files import cached_snapshot

        return cached_snapshot(cls.hub_repos, str(info.data.get("type", "")))

    @property
    def transformer_file(self) -> Path | None:
        """The older name of :attr:`diffusion_model` (plugins written before issue 35 read this)."""
        return self.diffusion_model

    def component_file_paths(self) -> dict[str, Path]:
        """The component files the table names, by key (``text_encoders`` as ``text_encoders[i]``)."""
        found = {k: getattr(self, k) for k in ("diffusion_model", "vae", "audio_vae") if getattr(self, k) is not None}
        for i, entry in enumerate(self.text_encoders):
            found[f"text_encoders[{i}]"] = entry if isinstance(entry, Path) else entry.path
        return found


class FlowMatchingConfig(ModelConfigBase):
    """Rectified-flow training times: how ``t`` is drawn, shifted and limited (:mod:`diffpipe_core.parts.flow`)."""

    timestep_sample_method: Literal["logit_normal", "uniform"] = Field(
        "logit_normal", description="How training times t in (0, 1) are drawn."
    )
    sigmoid_scale: float = Field(1.0, gt=0, description="logit_normal: t = sigmoid(sigmoid_scale * N(0, 1)).")
    shift: float = Field(1.0, gt=0, description="Time shift t' = shift*t / (1 + (shift-1)*t).")
    min_t: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Train only times t >= min_t (after the shift, t = 1 is pure noise): the drawn times are mapped "
        "linearly onto [min_t, max_t]. For a model that hands denoising to a second expert (Wan 2.2 A14B).",
    )
    max_t: float = Field(1.0, gt=0.0, le=1.0, description="Train only times t <= max_t (see min_t).")

    @model_validator(mode="after")
    def _range(self) -> FlowMatchingConfig:
        if self.min_t >= self.max_t:
            raise ValueError(f"min_t ({self.min_t}) must be below max_t ({self.max_t})")
        return self

    def given(self, key: str) -> bool:
        """Whether the run's ``[model]`` table set ``key`` itself rather than leaving it at its default (pydantic's
        ``model_fields_set``), so a default the model reads from its files can yield to what the user wrote."""
        return key in self.model_fields_set

    def time_range(self, default: tuple[float, float] = (0.0, 1.0)) -> tuple[float, float]:
        """``(min_t, max_t)`` of training times: each bound the table set itself, else ``default``'s (a model's own
        range, such as the noise range of one expert of a two-expert model). Raises ValueError naming both bounds
        when they leave no range."""
        low = self.min_t if self.given("min_t") else default[0]
        high = self.max_t if self.given("max_t") else default[1]
        if low >= high:
            raise ValueError(
                f"[model] min_t ({low}{'' if self.given('min_t') else ', the model default'}) must be below max_t "
                f"({high}{'' if self.given('max_t') else ', the model default'})"
            )
        return low, high

class DDPMConfig(ModelConfigBase):
    """DDPM training (SD 1.x/2.x, SDXL): the noise schedule, epsilon or v-prediction, loss weights, noise offset
    (:mod:`diffpipe_core.parts.ddpm`)."""

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
