"""Hook implementations of the SDXL model plugin (entry point ``sdxl``). Each hook delegates to the module
that does the work, imported when the hook is called: this module and ``model_spec`` import no torch, diffusers
or transformers, so commands that only list or validate plugins start at once."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core import ModelSpec, hookimpl
from diffpipe_sdxl.config import SDXLConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext

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
        block_layers=("UnitLayer",),
        adapter_formats=("diffusers", "kohya"),
        model_formats=("diffusers", "single_file"),
        description="Stable Diffusion XL (diffusers folder or single-file checkpoint); LoRA and full fine-tuning",
    )


@hookimpl
def validate_model_files(model_config: SDXLConfig) -> list[str]:
    """The diffusers SDXL folder (pipeline and component classes, tokenizers, UNet weights) or the single
    file's UNet keys, ``config_path`` and ``vae_path``, without reading weights."""
    from diffpipe_sdxl import files

    return files.problems(model_config)


@hookimpl
def load_encoders(model_config: SDXLConfig, device: torch.device) -> Any:
    """The VAE, both CLIP text encoders and their tokenizers."""
    from diffpipe_sdxl import loading

    return loading.load_encoders(model_config, device)


@hookimpl
def encode_batch(encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
    """Media: ``latents``, ``time_ids`` (and ``mask``); captions: ``text_embeds``, ``text_mask``, ``pooled``."""
    from diffpipe_sdxl import encoding

    return encoding.encode_batch(encoders, batch)


@hookimpl
def load_diffusion_model(model_config: SDXLConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The UNet (a skeleton on ``meta``)."""
    from diffpipe_sdxl import loading

    return loading.build_unet(model_config, device, dtype)


@hookimpl
def diffusion_model_weights(model_config: SDXLConfig) -> list[tuple[Path, Any]]:
    """The UNet's safetensors files and their key maps, for per-stage loading."""
    from diffpipe_sdxl import loading

    return loading.unet_weight_files(model_config)


@hookimpl
def split_into_layers(model: nn.Module, model_config: SDXLConfig) -> list[nn.Module]:
    """Embed, each down block, the mid block, each up block, the output head; skips travel in the tuple."""
    from diffpipe_sdxl import layers

    return layers.split_unet(model)


@hookimpl
def prepare_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator) -> Any:
    """DDPM noise and uniform integer timesteps; epsilon or v target; per-sample loss weights."""
    from diffpipe_sdxl import objective

    return objective.prepare_inputs(batch, context, generator)


@hookimpl
def compute_loss(outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Weighted, masked MSE."""
    from diffpipe_sdxl import objective

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
    from diffpipe_sdxl import export

    return export.export_adapter(state_dict, alpha, format)


@hookimpl
def adapter_key_names(modules: list[str], format: str) -> dict[str, str] | None:
    """LoKr/LoHa keys: ``kohya`` (the kohya LoRA's SGM module names)."""
    from diffpipe_sdxl import export

    return export.adapter_key_names(modules, format)


@hookimpl
def export_model(saved_dir: Path, model_config: SDXLConfig, out_dir: Path, format: str) -> bool | None:
    """``diffusers`` (a UNet folder) or ``single_file`` (an original-layout checkpoint with the base VAE and
    text encoders)."""
    from diffpipe_sdxl import export

    if format not in export.MODEL_FORMATS:
        return None
    export.export_saved_model(saved_dir, model_config, out_dir, format)
    return True
