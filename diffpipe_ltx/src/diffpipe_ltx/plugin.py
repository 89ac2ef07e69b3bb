"""Hook implementations of the LTX-Video model plugin (entry point ``ltx-video``).

This module and ``model_spec`` import no torch, diffusers or transformers: ``diffpipe --help``, ``models`` and
``validate`` load every plugin, so each hook imports the modules that do the work when it is called.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core import ModelSpec, hookimpl
from diffpipe_ltx.config import LTXConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext

# attn1 (self) and attn2 (cross) projections and the feed-forward linears of every block; nothing else in the
# model has modules of these names.
ATTENTION_AND_FF = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]


@hookimpl
def model_spec() -> ModelSpec:
    """LTX-Video: video (and image) model; VAE 32x spatial (patch 1), 8x temporal: frames 8k + 1 at 25 fps."""
    return ModelSpec(
        name="ltx-video",
        modality="video",
        config_schema=LTXConfig,
        spatial_multiple=32,
        frame_multiple=8,
        frame_offset=1,
        video_fps=25,
        encoder_settings=("path", "encoder_dtype", "t5_max_length"),
        block_layers=("BlockLayer",),
        adapter_formats=("diffusers", "comfyui"),
        model_formats=("diffusers", "single_file"),
        description="LTX-Video (diffusers folder or original Lightricks single-file transformer)",
    )


@hookimpl
def validate_model_files(model_config: LTXConfig) -> list[str]:
    """The diffusers LTX-Video folder (pipeline and component classes, tokenizer, transformer weights, component
    sizes) and the original single file's keys, without reading weights."""
    from diffpipe_ltx import files

    return files.problems(model_config)


@hookimpl
def load_encoders(model_config: LTXConfig, device: torch.device) -> Any:
    """The LTX-Video VAE and T5 with its tokenizer, from the diffusers folder."""
    from diffpipe_ltx import encoding

    return encoding.load_encoders(model_config, device)


@hookimpl
def encode_batch(encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
    """Media: ``latents`` (B, C, F, H/32, W/32), normalised like LTXPipeline's (images are one frame), and ``mask``
    (B, 1, H/32, W/32) when given. Captions: ``t5_embeds`` (B, t5_max_length, d) and ``t5_mask`` (B, t5_max_length)."""
    from diffpipe_ltx import encoding

    out: dict[str, torch.Tensor] = {}
    if batch.pixels is not None:
        out["latents"] = encoding.encode_pixels(encoders, batch.pixels)
        if batch.masks is not None:
            out["mask"] = encoding.downsample_mask(batch.masks, tuple(out["latents"].shape[-2:]))
    if batch.captions is not None:
        out.update(encoding.encode_captions(encoders, batch.captions))
    return out


@hookimpl
def load_diffusion_model(model_config: LTXConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The diffusers ``LTXVideoTransformer3DModel``, from the folder or the original single file. On ``meta``: a
    skeleton in ``dtype`` whose weights :func:`diffusion_model_weights` locates (either layout)."""
    import torch

    from diffpipe_ltx import loading

    if torch.device(device).type == "meta":
        return loading.build_transformer(model_config, "meta", dtype)
    return loading.load_transformer(model_config, device, dtype)


@hookimpl
def diffusion_model_weights(model_config: LTXConfig) -> list[tuple[Path, Callable[[str], str | None]]]:
    """Per-stage loading from either layout: the folder's files with their own keys, or the single file with
    its original names mapped to diffusers' (plain renames)."""
    from diffpipe_ltx import loading

    return loading.weight_sources(model_config)


@hookimpl
def split_into_layers(model: nn.Module, model_config: LTXConfig) -> list[nn.Module]:
    """Embedders (patch, time, caption, rotary), each transformer block, final norm/projection."""
    from diffpipe_ltx import layers, loading

    return layers.split_into_layers(model, loading.rope_interpolation_scale(model_config))


@hookimpl
def prepare_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
    """Rectified flow on packed latents with first-frame conditioning; see :mod:`diffpipe_ltx.inputs`."""
    from diffpipe_ltx.inputs import ltx_inputs

    return ltx_inputs(batch, context, generator)


@hookimpl
def compute_loss(outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """MSE to the velocity ``noise - latents``, weighted 0 on conditioned first frames and masked-out pixels."""
    from diffpipe_ltx.inputs import ltx_loss

    return ltx_loss(outputs, targets)


@hookimpl
def lora_targets(model_config: LTXConfig) -> list[str]:
    """Self- and cross-attention projections and the feed-forward linears of every block."""
    return list(ATTENTION_AND_FF)


@hookimpl
def adapter_key_prefix() -> str:
    return "transformer"


@hookimpl
def export_adapter(state_dict: dict[str, torch.Tensor], alpha: float, rank: int, format: str):
    """``diffusers`` (peft keys under ``transformer.``) and ``comfyui`` (``diffusion_model.`` + original names,
    ``.alpha`` per module)."""
    from diffpipe_ltx import export

    return export.export_adapter(state_dict, alpha, format)


@hookimpl
def export_model(saved_dir: Path, model_config: LTXConfig, out_dir: Path, format: str) -> bool | None:
    """``diffusers`` (a transformer folder) or ``single_file`` (original Lightricks layout), converted from the
    core's saved shards."""
    from diffpipe_ltx import export

    return export.export_model(saved_dir, model_config, out_dir, format)
