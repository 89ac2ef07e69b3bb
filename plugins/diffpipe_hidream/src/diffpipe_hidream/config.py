"""The ``[model]`` table of a HiDream-I1 run (pydantic and the standard library only: imported at start-up)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from diffpipe_core.parts.config import DiffusersModelConfig, FlowMatchingConfig


class HiDreamConfig(DiffusersModelConfig, FlowMatchingConfig):
    """``[model]`` keys of HiDream-I1 Full, Dev and Fast (which one is a matter of the weights and the folder's
    scheduler). ``path`` is a diffusers folder (``HiDreamImagePipeline``: CLIP-L ``text_encoder``, CLIP-G
    ``text_encoder_2``, T5 ``text_encoder_3``, Llama 3.1 ``text_encoder_4`` (``LlamaForCausalLM``) with
    ``tokenizer_4``, FLUX.1's 16-channel ``vae``); ``diffusion_model`` a single file as ComfyUI loads it
    (``hidream_i1_full_fp16.safetensors``: diffusers' names, optionally under ``model.diffusion_model.``)."""

    hub_repos: ClassVar[tuple[str, ...]] = (
        "HiDream-ai/HiDream-I1-Full",
        "HiDream-ai/HiDream-I1-Dev",
        "HiDream-ai/HiDream-I1-Fast",
    )

    text_max_length: int = Field(
        128,
        ge=1,
        le=512,
        description="Tokens per caption for CLIP (at most 218), T5 and Llama (HiDreamImagePipeline's "
        "max_sequence_length, default 128). Every Llama token is cached with all its hidden layers (32 x 4096 values "
        "for Llama 3.1 8B), so this sets the cache's size.",
    )
    shift: float | None = Field(
        None,
        gt=0,
        description="Time shift t' = shift*t / (1 + (shift-1)*t) of the training times. Default: the shift of the "
        "folder's scheduler (scheduler/scheduler_config.json's shift, or flow_shift for UniPC), which samples use: "
        "the variant's own (3.0 for Full and Fast, 6.0 for Dev as HiDream ships them).",
    )
    llama_4bit: bool = Field(
        False,
        description="Load Llama 3.1 (text_encoder_4) quantized to 4 bits (bitsandbytes nf4, computing in "
        "encoder_dtype) while caching, as diffusion-pipe's llama3_4bit: about 5.5 GiB instead of 16. The cached "
        "text then differs slightly from the unquantized encoder's. Needs the bitsandbytes package.",
    )
