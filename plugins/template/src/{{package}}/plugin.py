"""Hook implementations of the model ``{{name}}`` (its entry-point name).

``diffpipe models``, ``validate`` and ``--help`` import this module, so it imports no torch at top
level: the hooks import what they need when they run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffpipe_core import hookimpl

from {{package}}.config import ModelConfig

if TYPE_CHECKING:
    import torch
    from diffpipe_core import EncodeBatch, ModelSpec, TrainingContext
    from torch import nn

NAME = "{{name}}"


@hookimpl
def model_spec() -> ModelSpec:
    from diffpipe_core import ModelSpec

    return ModelSpec(
        name=NAME,
        modality="{{modality}}",
        config_schema=ModelConfig,
        spatial_multiple=16,  # VAE factor 8 x patch size 2
        frame_multiple={{frame_multiple}},  # video frame counts are frame_multiple * k + frame_offset
        frame_offset={{frame_offset}},
        video_fps={{video_fps}},
        encoder_settings=("path",),
        block_layers=("BlockLayer",),  # what activation checkpointing and block swapping act on
        adapter_formats=("diffusers",),
        model_formats=(),
        description="{{description}}",
    )


@hookimpl
def validate_model_files(model_config: ModelConfig) -> list[str]:
    from {{package}}.model import folder_problems

    return folder_problems(model_config.path)


@hookimpl
def load_encoders(model_config: ModelConfig, device: torch.device) -> Any:
    import torch

    from {{package}}.model import load_module

    vae = load_module("vae", model_config.path, device, torch.float32)
    text_encoder = load_module("text_encoder", model_config.path, device, torch.float32)
    return vae.eval(), text_encoder.eval()


@hookimpl
def encode_batch(encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
    import torch

    vae, text_encoder = encoders
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if batch.pixels is not None:  # (B, 3, H, W) images or (B, 3, F, H, W) videos
            out["latents"] = vae.encode(batch.pixels.to(vae.proj.weight.device, torch.float32))
            if batch.masks is not None:  # (B, 1, H, W), also for videos
                out["mask"] = vae.encode_mask(batch.masks)
        if batch.captions is not None:
            out["text_embeds"] = text_encoder(batch.captions)  # (B, text_len, text_dim) for every caption
    return out


@hookimpl
def load_diffusion_model(model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    from {{package}}.model import load_module

    return load_module("transformer", model_config.path, device, dtype)


@hookimpl
def diffusion_model_weights(model_config: ModelConfig) -> list:
    return [(model_config.path / "transformer.safetensors", lambda key: key)]


@hookimpl
def split_into_layers(model: nn.Module, model_config: ModelConfig) -> list[nn.Module]:
    from {{package}}.layers import split

    return split(model)


@hookimpl
def prepare_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
    import torch
    from diffpipe_core.diffusion import flow_matching_pair, sample_timesteps

    cfg: ModelConfig = context.model_config  # type: ignore[assignment]
    latents = batch["latents"].float()  # (B, C, F', h, w)
    noise = torch.randn(latents.shape, generator=generator)
    t = sample_timesteps(
        latents.shape[0],
        generator,
        cfg.timestep_sample_method,
        cfg.sigmoid_scale,
        cfg.shift,
        quantile=context.eval_quantile,
    )
    x_t, target = flow_matching_pair(latents, noise, t)
    targets = (target, batch["mask"]) if "mask" in batch else (target,)
    return (x_t, t, batch["text_embeds"].float()), targets


@hookimpl
def compute_loss(
    outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...], context: TrainingContext
) -> torch.Tensor:
    from diffpipe_core.diffusion import training_loss

    # the run's loss (squared error, or pseudo_huber_c / huber_delta / smooth_l1_beta), mask-weighted
    return training_loss(outputs[0], targets[0], targets[1] if len(targets) > 1 else None, context)


@hookimpl
def lora_targets(model_config: ModelConfig) -> list[str]:
    return ["to_q", "to_k", "to_v", "to_out", "fc1", "fc2"]


@hookimpl
def adapter_key_prefix() -> str:
    return "transformer"
