"""The ``[model]`` table of an LTX-Video run (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig


class LTXConfig(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of LTX-Video. ``path`` is a diffusers LTX-Video folder; ``diffusion_model`` a single file in
    the original Lightricks key layout (``ltx-video-2b-v0.9.safetensors``: ``model.diffusion_model.patchify_proj``,
    ...), whose transformer replaces the folder's; ``vae`` the same checkpoint (its ``vae.*``) or a VAE file,
    ``text_encoders`` ComfyUI's ``t5xxl_fp16.safetensors``."""

    hub_repos: ClassVar[tuple[str, ...]] = ("Lightricks/LTX-Video",)

    t5_max_length: int = Field(
        128, ge=1, le=512, description="T5 tokens (padded/truncated; LTXPipeline's max_sequence_length default)."
    )
    resolution_shift: bool = Field(
        False,
        description="LTXPipeline's sequence-length-dependent shift instead of shift: e^mu, mu linear in the latent "
        "token count (frames x height x width) with the constants of path/scheduler/scheduler_config.json.",
    )
    first_frame_conditioning_p: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Probability that a video's first latent frame stays clean (timestep 0) and is left out of the "
        "loss: trains image-to-video. Images (one latent frame) are never conditioned.",
    )


class LTX2Config(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of LTX-2. ``path`` is a diffusers ``LTX2Pipeline`` / ``LTX2ImageToVideoPipeline`` folder;
    ``diffusion_model`` a single file in the original Lightricks layout (``ltx-2-19b-dev.safetensors``:
    ``model.diffusion_model.patchify_proj``, ``...audio_adaln_single``, ...), whose transformer replaces the folder's
    (the VAEs, Gemma 3 and the text connectors still come from ``path``)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("Lightricks/LTX-2",)

    max_sequence_length: int = Field(
        1024,
        ge=1,
        le=4096,
        description="Gemma tokens (left-padded/truncated; LTX2Pipeline's max_sequence_length default). A multiple "
        "of the text connectors' learnable registers (128 in LTX-2).",
    )
    resolution_shift: bool = Field(
        False,
        description="LTX2Pipeline's sequence-length-dependent shift instead of shift: e^mu, mu linear in the video "
        "token count (frames x height x width) with the constants of path/scheduler/scheduler_config.json.",
    )
    first_frame_conditioning_p: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Probability that a clip trains image-to-video as LTX2ImageToVideoPipeline runs it: its first "
        "latent frame is the clip's first frame encoded alone, clean (timestep 0), and left out of the loss. Images "
        "(one latent frame) are never conditioned.",
    )
    sample_image: Path | None = Field(
        None,
        description="A first frame (PNG/JPG) that makes the samples during training (and `diffpipe sample`) "
        "image-to-video, as LTX2ImageToVideoPipeline generates them from its image: resized to the sample size, "
        "H.264 re-compressed at the pipeline's default CRF, encoded alone and kept clean (timestep 0) as the first "
        "latent frame. Unset: text-to-video samples, as LTX2Pipeline.",
    )
    train_audio: bool = Field(
        False,
        description="Train the audio stream on the clips' sound: each clip's audio track (resampled to the audio "
        "VAE's sample_rate, over the clip's frames) is cached as audio latents through path/audio_vae, noised at the "
        "video's time, and its velocity is in the loss; the LoRA also targets the audio stream and the audio-video "
        "cross-attentions. Items without sound (images, videos without a track) weigh 0 in the audio loss. False: the "
        "audio stream gets noise and weighs 0 (video-only training, as before).",
    )
    train_video: bool = Field(
        True,
        description="Train the video stream (its loss and LoRA targets). false with train_audio = true: an "
        "audio-only LoRA (the video latents still go in, noised, as context).",
    )

    @model_validator(mode="after")
    def _trains_something(self) -> LTX2Config:
        if not (self.train_audio or self.train_video):
            raise ValueError("train_video = false and train_audio = false leave nothing to train; set one to true")
        return self


class LTX23Config(LTX2Config):
    """``[model]`` keys of LTX-2.3 (as LTX-2's). ``path`` is a diffusers ``LTX2Pipeline`` folder of an LTX-2.3
    transformer (``cross_attn_mod``, no caption projection; connectors with ``per_modality_projections``)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("Lightricks/LTX-2.3",)


class LTX25Config(LTX2Config):
    """``[model]`` keys of LTX-2.5 (as LTX-2's). ``path`` is a diffusers ``LTX25ModularPipeline`` folder
    (``modular_model_index.json``): LTX-2.3's layout with static prompt tables (``use_prompt_adaln_single = false``)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("Lightricks/LTX-2.5",)
