"""Hook implementations of the SDXL model plugin (entry point ``sdxl``). Each hook delegates to the module
that does the work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffpipe_core import EncodeBatch, ModelSpec, TrainingContext, hookimpl
from diffpipe_sdxl import encoding, export, layers, loading, objective
from diffpipe_sdxl.config import SDXLConfig

#: attention and feed-forward linears of the UNet's transformer blocks
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]


@hookimpl
def model_spec() -> ModelSpec:
    """SDXL: images, VAE factor 8, sizes rounded to multiples of 64 (SDXL's bucket grid)."""
    return ModelSpec(
        name="sdxl",
        modality="image",
        config_schema=SDXLConfig,
        spatial_multiple=64,
        encoder_settings=("path", "config_path", "vae_path", "vae_dtype", "text_encoder_dtype", "max_prompt_chunks"),
        description="Stable Diffusion XL (diffusers folder or single-file checkpoint); LoRA and full fine-tuning",
    )


@hookimpl
def load_encoders(model_config: SDXLConfig, device: torch.device) -> Any:
    """The VAE, both CLIP text encoders and their tokenizers."""
    return loading.load_encoders(model_config, device)


@hookimpl
def encode_batch(encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
    """Media: ``latents``, ``time_ids`` (and ``mask``); captions: ``text_embeds``, ``text_mask``, ``pooled``."""
    return encoding.encode_batch(encoders, batch)


@hookimpl
def load_diffusion_model(model_config: SDXLConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The UNet (a skeleton on ``meta``)."""
    return loading.build_unet(model_config, device, dtype)


@hookimpl
def diffusion_model_weights(model_config: SDXLConfig) -> list[tuple[Path, Any]]:
    """The UNet's safetensors files and their key maps, for per-stage loading."""
    return loading.unet_weight_files(model_config)


@hookimpl
def split_into_layers(model: nn.Module, model_config: SDXLConfig) -> list[nn.Module]:
    """Embed, each down block, the mid block, each up block, the output head; skips travel in the tuple."""
    return layers.split_unet(model)


@hookimpl
def prepare_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator) -> Any:
    """DDPM noise and uniform integer timesteps; epsilon or v target; per-sample loss weights."""
    return objective.prepare_inputs(batch, context, generator)


@hookimpl
def compute_loss(outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Weighted, masked MSE."""
    return objective.compute_loss(outputs, targets)


@hookimpl
def lora_targets(model_config: SDXLConfig) -> list[str]:
    """Attention (q, k, v, out) and feed-forward linears of every transformer block."""
    return list(LORA_TARGETS)


@hookimpl
def adapter_key_prefix() -> str:
    """The UNet's prefix in ``StableDiffusionXLPipeline``."""
    return "unet"


@hookimpl
def export_adapter(state_dict: dict[str, torch.Tensor], alpha: float, rank: int, format: str) -> Any:
    """``diffusers`` or ``kohya`` (original SGM module names)."""
    return export.export_adapter(state_dict, alpha, format)


@hookimpl
def export_model(saved_dir: Path, model_config: SDXLConfig, out_dir: Path, format: str) -> bool | None:
    """``diffusers`` (a UNet folder) or ``single_file`` (an original-layout checkpoint with the base VAE and
    text encoders)."""
    if format not in export.MODEL_FORMATS:
        return None
    export.export_saved_model(saved_dir, model_config, out_dir, format)
    return True
