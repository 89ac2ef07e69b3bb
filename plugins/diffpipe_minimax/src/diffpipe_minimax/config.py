"""The ``[model]`` table of a MiniMax H3 run (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig


class MiniMaxH3Config(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of MiniMax H3. ``path`` is a diffusers ``MiniMaxH3ModularPipeline`` folder
    (``modular_model_index.json``, or ``model_index.json`` naming it): ``transformer``, the video ``vae``, the
    ``audio_vae``, the Qwen3-VL ``text_encoder`` with its ``tokenizer`` and ``processor``."""

    hub_repos: ClassVar[tuple[str, ...]] = ("MiniMaxAI/MiniMax-H3",)

    text_max_length: int = Field(
        512,
        ge=1,
        description="Qwen3-VL tokens of a caption kept in the cache. The pipeline encodes the prompt verbatim (no "
        "template, no special tokens) and conditions on every token, so a longer caption is refused while caching, "
        "naming it. Captions of one micro-batch are padded to the longest, the padding masked.",
    )
    shift: float = Field(
        12.0,
        gt=0,
        description="Time shift t' = shift*t / (1 + (shift-1)*t) of the video's training times: 12.0 is the "
        "pipeline's video scheduler shift.",
    )
    video_shift: float = Field(
        12.0, gt=0, description="The video schedule's shift that audio_shift is paired with (the pipeline's 12.0)."
    )
    audio_shift: float = Field(
        3.0,
        gt=0,
        description="The audio stream's shift (the pipeline's audio scheduler, 3.0): each sample's audio noise level "
        "is its video level unshifted by video_shift and shifted by audio_shift, as the pipeline pairs its two "
        "schedules at every step.",
    )
    train_audio: bool = Field(
        False,
        description="Train the audio stream on the clips' sound: each clip's audio track (resampled to the audio "
        "VAE's sampling_rate, over the clip's frames, stereo) is cached as audio latents through the audio_vae, "
        "noised at the sample's audio level and kept in the loss (every video and audio value counting the same). "
        "Clips without sound and images get noise rows outside the loss in a micro-batch with sound, none otherwise.",
    )
    train_video: bool = Field(
        True, description="Train the video stream's loss. false with train_audio = true: the video only as context."
    )
    @model_validator(mode="after")
    def _something_trains(self) -> MiniMaxH3Config:
        if not (self.train_audio or self.train_video):
            raise ValueError("train_video = false and train_audio = false leave nothing to train; set one to true")
        return self
