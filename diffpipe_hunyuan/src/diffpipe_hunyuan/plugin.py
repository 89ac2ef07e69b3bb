"""Hook implementations of the HunyuanVideo model plugin (entry point ``hunyuan-video``).

This module and ``model_spec`` import no torch, diffusers or transformers: ``diffpipe --help``, ``models`` and
``validate`` load every plugin, so each hook imports the modules that do the work when it is called.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core import ModelSpec, hookimpl
from diffpipe_hunyuan.config import HunyuanConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_hunyuan import encoding

DOUBLE_BLOCK_LINEARS = (
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
    "norm1.linear",
    "norm1_context.linear",
)
SINGLE_BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out", "norm.linear")


@hookimpl
def model_spec() -> ModelSpec:
    """HunyuanVideo: video model (images train as 1-frame videos); VAE 8x spatial x 2x2 patches = multiples of
    16 pixels; 4x temporal, so frame counts are 4k + 1; clips resampled to 24 fps."""
    return ModelSpec(
        name="hunyuan-video",
        modality="video",
        config_schema=HunyuanConfig,
        spatial_multiple=16,
        frame_multiple=4,
        frame_offset=1,
        video_fps=24.0,
        encoder_settings=(
            "path",
            "encoder_dtype",
            "text_max_length",
            "text_crop_start",
            "vae_tiling",
            "vae_tile_size",
            "vae_tile_frames",
        ),
        block_layers=("DoubleBlockLayer", "SingleBlockLayer"),
        adapter_formats=("diffusers", "comfyui"),
        model_formats=("diffusers", "single_file"),
        description="HunyuanVideo text-to-video (diffusers folder or original single-file transformer)",
    )


@hookimpl
def validate_model_files(model_config: HunyuanConfig) -> list[str]:
    """The diffusers HunyuanVideo folder (pipeline and component classes, tokenizers, transformer weights) and
    the original-layout transformer file's keys, without reading weights."""
    from diffpipe_hunyuan import files

    return files.problems(model_config)


@hookimpl
def load_encoders(model_config: HunyuanConfig, device: torch.device) -> Any:
    """The video VAE (tiling/slicing as configured), Llama and CLIP-L with their tokenizers."""
    from diffpipe_hunyuan import encoding

    return encoding.load_encoders(model_config, device)


@hookimpl
def encode_batch(encoders: encoding.HunyuanEncoders, batch: EncodeBatch) -> dict[str, torch.Tensor]:
    """Media: ``latents`` (B, C, F', H/8, W/8) scaled (images as 1 frame), ``mask`` (B, 1, 1, H/8, W/8) when given.
    Captions: ``text_embeds`` (B, text_max_length, d), ``text_mask`` (B, text_max_length), ``clip_pooled`` (B, d)."""
    from diffpipe_hunyuan import encoding

    out: dict[str, torch.Tensor] = {}
    if batch.pixels is not None:
        out["latents"] = encoding.encode_pixels(encoders, batch.pixels)
        if batch.masks is not None:
            out["mask"] = encoding.latent_mask(batch.masks, tuple(out["latents"].shape[-2:]))
    if batch.captions is not None:
        out.update(encoding.encode_captions(encoders, batch.captions))
    return out


@hookimpl
def load_diffusion_model(model_config: HunyuanConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The diffusers ``HunyuanVideoTransformer3DModel``. On ``meta``: a skeleton (cast like ``from_pretrained``)
    whose weights :func:`diffusion_model_weights` locates; otherwise the whole model, from the folder or converted
    from the original-layout single file."""
    import torch

    from diffpipe_hunyuan import loading

    if torch.device(device).type == "meta":
        return loading.build_transformer(model_config, "meta", dtype)
    return loading.load_transformer(model_config, device, dtype)


@hookimpl
def diffusion_model_weights(model_config: HunyuanConfig) -> list[tuple[Path, Callable[[str], Any]]]:
    """Per-stage loading from the diffusers folder (keys are the model's own) or from the original-layout single
    file, whose key map splits a fused tensor (``img_attn_qkv``, ``linear1``) only for the stage holding its block."""
    from diffpipe_hunyuan import loading
    from diffpipe_hunyuan.original import single_file_key_map

    if model_config.transformer_file is not None:
        return [(model_config.transformer_file, single_file_key_map(loading.transformer_config(model_config)))]
    return [(file, lambda key: key) for file in loading.folder_weight_files(model_config)]


@hookimpl
def split_into_layers(model: nn.Module, model_config: HunyuanConfig) -> list[nn.Module]:
    """Embedders + token refiner (+ rotary embedding, computed once), each double block, each single block,
    final norm/projection."""
    from diffpipe_hunyuan import layers

    return layers.split_into_layers(model)


@hookimpl
def prepare_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
    """Rectified flow on the video latents; see :func:`diffpipe_hunyuan.inputs.hunyuan_inputs`."""
    from diffpipe_hunyuan.inputs import hunyuan_inputs

    return hunyuan_inputs(batch, context, generator)


@hookimpl
def compute_loss(outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """MSE to the velocity ``noise - latents`` (mask-weighted when the dataset gives masks)."""
    from diffpipe_hunyuan.inputs import hunyuan_loss

    return hunyuan_loss(outputs, targets)


@hookimpl
def lora_targets(model_config: HunyuanConfig) -> list[str]:
    """Every linear of the double- and single-stream blocks (attention, MLP, modulation), by full name: the
    token refiner and the final layer use the same short names and are not adapted."""
    from diffpipe_hunyuan import loading

    config = loading.transformer_config(model_config)
    n_double, n_single = int(config["num_layers"]), int(config["num_single_layers"])
    doubles = [f"transformer_blocks.{i}.{m}" for i in range(n_double) for m in DOUBLE_BLOCK_LINEARS]
    singles = [f"single_transformer_blocks.{i}.{m}" for i in range(n_single) for m in SINGLE_BLOCK_LINEARS]
    return doubles + singles


@hookimpl
def adapter_key_prefix() -> str:
    return "transformer"


@hookimpl
def export_adapter(state_dict: dict[str, torch.Tensor], alpha: float, rank: int, format: str):
    """``diffusers`` (peft keys under ``transformer.``) and ``comfyui`` (native keys, fused q/k/v, ``.alpha``)."""
    from diffpipe_hunyuan import export

    return export.export_adapter(state_dict, alpha, format)


@hookimpl
def export_model(saved_dir: Path, model_config: HunyuanConfig, out_dir: Path, format: str) -> bool | None:
    """``diffusers`` (a transformer folder) or ``single_file`` (one original-layout safetensors file),
    converted from the core's saved shards."""
    from diffpipe_hunyuan import export, loading

    return export.export_model(saved_dir, loading.transformer_config(model_config), out_dir, format)
