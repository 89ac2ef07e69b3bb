"""Hook implementations of the Flux model plugin (entry point ``flux``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffpipe_core import EncodeBatch, ModelSpec, TrainingContext, hookimpl
from diffpipe_flux import encoding, export, layers, loading
from diffpipe_flux.config import FluxConfig
from diffpipe_flux.inputs import flux_inputs, flux_loss

ATTENTION_AND_MLP = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
    "proj_mlp",
]


@hookimpl
def model_spec() -> ModelSpec:
    """Flux: image model, VAE factor 8 x 2x2 packing = multiples of 16 pixels."""
    return ModelSpec(
        name="flux",
        modality="image",
        config_schema=FluxConfig,
        spatial_multiple=16,
        encoder_settings=("path", "encoder_dtype", "t5_max_length"),
        description="Flux.1 dev/schnell (diffusers folder or BFL single-file transformer)",
    )


@hookimpl
def load_encoders(model_config: FluxConfig, device: torch.device) -> Any:
    """VAE, CLIP-L and T5 with their tokenizers, from the diffusers folder."""
    return encoding.load_encoders(model_config, device)


@hookimpl
def encode_batch(encoders: encoding.FluxEncoders, batch: EncodeBatch) -> dict[str, torch.Tensor]:
    """Media: ``latents`` (B, C, H/8, W/8) shifted and scaled, ``mask`` on the latent grid when given.
    Captions: ``t5_embeds`` (B, t5_max_length, d) and ``clip_pooled`` (B, d)."""
    out: dict[str, torch.Tensor] = {}
    if batch.pixels is not None:
        out["latents"] = encoding.encode_pixels(encoders, batch.pixels)
        if batch.masks is not None:
            out["mask"] = encoding.downsample_mask(batch.masks, tuple(out["latents"].shape[-2:]))
    if batch.captions is not None:
        out.update(encoding.encode_captions(encoders, batch.captions))
    return out


@hookimpl
def load_diffusion_model(model_config: FluxConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The diffusers ``FluxTransformer2DModel``. On ``meta`` from a diffusers folder: a skeleton whose weights
    :func:`diffusion_model_weights` locates. A BFL single file is converted on load, so it is always read whole."""
    if torch.device(device).type == "meta" and model_config.transformer_file is None:
        return loading.build_transformer(model_config, "meta", dtype)
    real = torch.device("cpu") if torch.device(device).type == "meta" else device
    return loading.load_transformer(model_config, real, dtype)


@hookimpl
def diffusion_model_weights(model_config: FluxConfig) -> list[tuple[Path, Callable[[str], str | None]]]:
    """Per-stage loading from the diffusers folder (keys are the model's own). A BFL file needs fused tensors
    split, so that layout is loaded whole by :func:`load_diffusion_model` and no files are listed here."""
    if model_config.transformer_file is not None:
        return []
    return [(file, lambda key: key) for file in loading.folder_weight_files(model_config)]


@hookimpl
def split_into_layers(model: nn.Module, model_config: FluxConfig) -> list[nn.Module]:
    """Embedders, each double block, each single block, final norm/projection."""
    return layers.split_into_layers(model)


@hookimpl
def prepare_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
    """Rectified flow on packed latents; see :func:`diffpipe_flux.inputs.flux_inputs`."""
    return flux_inputs(batch, context, generator)


@hookimpl
def compute_loss(outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """MSE to the velocity ``noise - latents`` (mask-weighted when the dataset gives masks)."""
    return flux_loss(outputs, targets)


@hookimpl
def lora_targets(model_config: FluxConfig) -> list[str]:
    """Attention and MLP linears of the double and single blocks. A single block's output linear is named
    ``proj_out`` like the model's final projection, so those are listed by full name."""
    n_single = int(loading.transformer_config(model_config).get("num_single_layers", 0))
    return ATTENTION_AND_MLP + [f"single_transformer_blocks.{i}.proj_out" for i in range(n_single)]


@hookimpl
def adapter_key_prefix() -> str:
    return export.PREFIX


@hookimpl
def export_adapter(state_dict: dict[str, torch.Tensor], alpha: float, rank: int, format: str):
    """``diffusers`` (peft keys under ``transformer.``) and ``comfyui`` (BFL-native keys, fused q/k/v, ``.alpha``)."""
    return export.export_adapter(state_dict, alpha, format)


@hookimpl
def export_model(saved_dir: Path, model_config: FluxConfig, out_dir: Path, format: str) -> bool | None:
    """``diffusers`` (a transformer folder) or ``single_file`` (one original BFL-layout safetensors file),
    converted from the core's saved shards."""
    config = model_config.path / loading.TRANSFORMER / "config.json"
    return export.export_model(saved_dir, config, out_dir, format)
