"""Hook implementations of the Flux model plugin (entry point ``flux``).

This module and ``model_spec`` import no torch, diffusers or transformers: ``diffpipe --help``, ``models`` and
``validate`` load every plugin, so each hook imports the modules that do the work when it is called.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core import ModelSpec, hookimpl
from diffpipe_flux.config import FluxConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest
    from diffpipe_flux import encoding

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
        block_layers=("DoubleBlockLayer", "SingleBlockLayer"),
        adapter_formats=("diffusers", "comfyui"),
        model_formats=("diffusers", "single_file"),
        description="Flux.1 dev/schnell (diffusers folder or BFL single-file transformer)",
    )


@hookimpl
def validate_model_files(model_config: FluxConfig) -> list[str]:
    """The diffusers Flux folder (pipeline and component classes, tokenizers, transformer weights) and the
    BFL transformer file's keys, without reading weights."""
    from diffpipe_flux import files

    return files.problems(model_config)


@hookimpl
def load_encoders(model_config: FluxConfig, device: torch.device) -> Any:
    """VAE, CLIP-L and T5 with their tokenizers, from the diffusers folder."""
    from diffpipe_flux import encoding

    return encoding.load_encoders(model_config, device)


@hookimpl
def encode_batch(encoders: encoding.FluxEncoders, batch: EncodeBatch) -> dict[str, torch.Tensor]:
    """Media: ``latents`` (B, C, H/8, W/8) shifted and scaled, ``mask`` on the latent grid when given.
    Captions: ``t5_embeds`` (B, t5_max_length, d) and ``clip_pooled`` (B, d)."""
    from diffpipe_flux import encoding

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
    """The diffusers ``FluxTransformer2DModel``. On ``meta``: a skeleton whose weights
    :func:`diffusion_model_weights` locates, in the diffusers folder or the BFL single file."""
    import torch

    from diffpipe_flux import loading

    if torch.device(device).type == "meta":
        return loading.build_transformer(model_config, "meta", dtype)
    return loading.load_transformer(model_config, device, dtype)


@hookimpl
def diffusion_model_weights(model_config: FluxConfig) -> list[tuple[Path, Callable[[str], str | None]]]:
    """Per-stage loading from the diffusers folder (keys are the model's own) or from the BFL single file, whose
    key map splits a fused tensor (``img_attn.qkv``, ``linear1``) only for a stage that holds its block."""
    from diffpipe_flux import loading

    if model_config.transformer_file is not None:
        return [(model_config.transformer_file, loading.single_file_key_map(model_config))]
    return [(file, lambda key: key) for file in loading.folder_weight_files(model_config)]


@hookimpl
def split_into_layers(model: nn.Module, model_config: FluxConfig) -> list[nn.Module]:
    """Embedders, each double block, each single block, final norm/projection."""
    from diffpipe_flux import layers

    return layers.split_into_layers(model)


@hookimpl
def prepare_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
    """Rectified flow on packed latents; see :func:`diffpipe_flux.inputs.flux_inputs`."""
    from diffpipe_flux.inputs import flux_inputs

    return flux_inputs(batch, context, generator)


@hookimpl
def compute_loss(outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """MSE to the velocity ``noise - latents`` (mask-weighted when the dataset gives masks)."""
    from diffpipe_flux.inputs import flux_loss

    return flux_loss(outputs, targets)


@hookimpl
def lora_targets(model_config: FluxConfig) -> list[str]:
    """Attention and MLP linears of the double and single blocks. A single block's output linear is named
    ``proj_out`` like the model's final projection, so those are listed by full name."""
    from diffpipe_flux import loading

    n_single = int(loading.transformer_config(model_config).get("num_single_layers", 0))
    return ATTENTION_AND_MLP + [f"single_transformer_blocks.{i}.proj_out" for i in range(n_single)]


@hookimpl
def adapter_key_prefix() -> str:
    from diffpipe_flux import export

    return export.PREFIX


@hookimpl
def export_adapter(state_dict: dict[str, torch.Tensor], alpha: float, rank: int, format: str):
    """``diffusers`` (peft keys under ``transformer.``) and ``comfyui`` (BFL-native keys, fused q/k/v, ``.alpha``)."""
    from diffpipe_flux import export

    return export.export_adapter(state_dict, alpha, format)


@hookimpl
def adapter_key_names(modules: list[str], format: str) -> dict[str, str] | None:
    """LoKr/LoHa keys: ``comfyui`` (diffusers names under ``transformer.``, which ComfyUI maps into BFL weights)."""
    from diffpipe_flux import export

    return export.adapter_key_names(modules, format)


@hookimpl
def export_model(saved_dir: Path, model_config: FluxConfig, out_dir: Path, format: str) -> bool | None:
    """``diffusers`` (a transformer folder) or ``single_file`` (one original BFL-layout safetensors file),
    converted from the core's saved shards."""
    from diffpipe_flux import export, loading

    config = model_config.path / loading.TRANSFORMER / "config.json"
    return export.export_model(saved_dir, config, out_dir, format)


@hookimpl
def denoise_init(request: SampleRequest, model_config: FluxConfig, generator: torch.Generator):
    """Noise ``(1, C, H/8, W/8)`` and FluxPipeline's resolution-shifted flow-matching sigmas."""
    from diffpipe_flux import sampling

    return sampling.denoise_init(request, model_config, generator)


@hookimpl
def denoise_inputs(latents, schedule, index, text, request, model_config):
    """Packed latents, t, T5 and CLIP embeddings, guidance (``[sample] guidance``, default 3.5), position ids."""
    from diffpipe_flux import sampling

    return sampling.denoise_inputs(latents, schedule, index, text, request)


@hookimpl
def denoise_step(latents, prediction, schedule, index, model_config):
    """Flow-matching Euler step."""
    from diffpipe_flux import sampling

    return sampling.denoise_step(latents, prediction, schedule, index)


@hookimpl
def load_decoder(model_config: FluxConfig, device: torch.device) -> Any:
    """The VAE alone (``encoder_dtype``)."""
    from diffpipe_flux import sampling

    return sampling.load_decoder(model_config, device)


@hookimpl
def decode_latents(decoder: Any, latents: torch.Tensor) -> torch.Tensor:
    from diffpipe_flux import sampling

    return sampling.decode_latents(decoder, latents)
