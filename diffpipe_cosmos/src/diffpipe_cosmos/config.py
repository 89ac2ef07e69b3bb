"""The ``[model]`` tables of the two Cosmos entry points (pydantic and stdlib only: read before torch loads)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig


class CosmosConfigBase(DiffusersModelConfig):
    """``[model]`` keys common to Cosmos-1.0 and Cosmos-Predict2. ``diffusion_model``: NVIDIA's original layout
    (``net.blocks...``)."""

    t5_max_length: int = Field(
        512, ge=1, le=512, description="T5 token count; captions are padded (zero embeddings) or truncated to it."
    )
    fps: float | None = Field(
        None,
        gt=0,
        description="Frame rate given to the transformer's rotary embedding for videos (None: the model default "
        "of the entry point). Images (1 latent frame) get none, as in the text-to-image pipelines.",
    )
    conditioning: Literal["text", "video"] = Field(
        "text",
        description='"text": text-to-world. "video": video-to-world (a video-to-world transformer, in_channels = '
        "out_channels + 1): each clip's first conditioning_frames latent frames are given clean, as "
        "CosmosVideoToWorldPipeline / Cosmos2VideoToWorldPipeline give the conditioning video's, and the loss covers "
        "the frames after them; images (1 latent frame) train unconditioned.",
    )
    conditioning_frames: int = Field(
        1,
        ge=1,
        description='conditioning = "video": latent frames each clip is conditioned on (the pipelines\' conditioning '
        "latent frames: 1 for an image, 1 + (pixel frames - 1) // temporal compression for a video); a clip with no "
        "more latent frames than this is conditioned on all but its last.",
    )
    sample_video: Path | None = Field(
        None,
        description='conditioning = "video": the video (or image) file samples continue: its first '
        "1 + temporal compression * (conditioning_frames - 1) frames (an image: itself), resized to the sample size "
        "as the video-to-world pipeline resizes its video.",
    )


class Cosmos1Config(CosmosConfigBase):
    """``[model]`` keys of Cosmos-1.0 Diffusion text-to-world (EDM training)."""

    sigma_data: float = Field(0.5, gt=0, description="EDM sigma_data (the Cosmos-1.0 scheduler's).")
    p_mean: float = Field(0.0, description="Training noise levels: log sigma ~ N(p_mean, p_std).")
    p_std: float = Field(1.0, gt=0, description="Training noise levels: log sigma ~ N(p_mean, p_std).")
    augment_sigma: float = Field(
        0.001,
        ge=0,
        description='conditioning = "video": noise level of the conditioning latents (CosmosVideoToWorldPipeline\'s '
        "augment_sigma); at noise levels not above it the frames are not conditioned, as in the pipeline.",
    )


class Predict2Config(CosmosConfigBase, FlowMatchingConfig):
    """``[model]`` keys of Cosmos-Predict2 (text-to-image and video; rectified-flow training). NVIDIA's
    ``log sigma ~ N(mu, s)`` in ``sigma = t / (1 - t)`` is ``logit_normal`` with ``sigmoid_scale = s``,
    ``shift = e^mu``."""

    hub_repos: ClassVar[tuple[str, ...]] = (
        "nvidia/Cosmos-Predict2-2B-Text2Image",
        "nvidia/Cosmos-Predict2-14B-Text2Image",
        "nvidia/Cosmos-Predict2-2B-Video2World",
        "nvidia/Cosmos-Predict2-14B-Video2World",
    )

    nvidia_weighting: bool = Field(
        False,
        description="Weight each sample's velocity loss by t^2 + (1-t)^2: NVIDIA's EDM loss weight (sigma_data 1) "
        "rewritten in t. Off: the plain rectified-flow MSE.",
    )
    sigma_conditioning: float = Field(
        0.0001,
        ge=0,
        description='conditioning = "video": the noise level the conditioning frames are given at (timestep '
        "sigma / (1 + sigma); Cosmos2VideoToWorldPipeline's sigma_conditioning).",
    )


class Predict25Config(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of Cosmos-Predict2.5 (text-to-world, images as 1-frame videos; rectified-flow training as
    Predict2, whose ``nvidia_weighting`` it shares). Its diffusers folders only: NVIDIA publishes the original 2.5
    checkpoints as pickles and ComfyUI has no 2.5 model, so there is no single-file layout (``diffusion_model``)."""

    text_max_length: int = Field(
        512,
        ge=1,
        description="Qwen2.5-VL tokens of the chat-templated caption, padded or truncated to it (the pipeline's "
        "max_sequence_length); the transformer attends to every position.",
    )
    nvidia_weighting: bool = Predict2Config.model_fields["nvidia_weighting"]


class AnimaConfig(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of Anima (a Cosmos-Predict2 transformer with an LLM adapter, Qwen3 text, Qwen-Image's VAE;
    rectified-flow training). ``path``: a diffusers ``AnimaModularPipeline`` folder (``modular_model_index.json``);
    ``diffusion_model``: the single file ComfyUI loads (``anima-base.safetensors``: NVIDIA's Predict2 names under
    ``net.``, the LLM adapter under ``net.llm_adapter.``); ``vae``: ``qwen_image_vae.safetensors``;
    ``text_encoders``: Qwen3 0.6B (``qwen_3_06b_base.safetensors``)."""

    hub_repos: ClassVar[tuple[str, ...]] = ("circlestone-labs/Anima-Base-v1.0-Diffusers",)

    text_max_length: int = Field(
        512,
        ge=1,
        le=4096,
        description="Qwen3 and T5 tokens kept of a caption (the pipeline's max_sequence_length); longer captions are "
        "truncated as the pipeline truncates them. The padding is masked and not stored as text.",
    )
    llm_adapter_lr: float = Field(
        0.0,
        ge=0,
        description="Learning rate of the LLM adapter (the model's text conditioner, parameter group 'llm_adapter'). "
        "0 (the default, as Anima's authors and diffusion-pipe recommend: the adapter is sensitive and small "
        "datasets degrade it): frozen, and no LoRA on it. Above 0: trained at this rate (a LoRA then also targets "
        "its blocks' linears). [optimizer] group_lr = { llm_adapter = ... } overrides the rate, not the targets.",
    )
