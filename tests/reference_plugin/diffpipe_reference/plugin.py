"""Hook implementations of the reference model (entry point ``reference``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from diffpipe_core import EncodeBatch, ModelConfigBase, ModelSpec, TrainingContext, hookimpl
from diffpipe_core.diffusion import flow_matching_pair, masked_mse, sample_timesteps
from diffpipe_reference.model import ByteTextEncoder, TinyDiT, TinyVAE, load_module

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ReferenceConfig(ModelConfigBase):
    """``[model]`` keys of the reference model."""

    path: Path = Field(description="Folder written by diffpipe_reference.model.write_tiny_model.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Base weight dtype.")
    timestep_sample_method: Literal["logit_normal", "uniform"] = Field("logit_normal", description="t sampling.")
    sigmoid_scale: float = Field(1.0, gt=0, description="Scale of the logit-normal distribution.")
    shift: float = Field(1.0, gt=0, description="Time shift applied after sampling.")


@hookimpl
def model_spec() -> ModelSpec:
    return ModelSpec(
        name="reference",
        modality="image",
        config_schema=ReferenceConfig,
        spatial_multiple=16,
        encoder_settings=("path",),
        description="Tiny pure-PyTorch DiT for tests and the demo",
    )


@hookimpl
def load_encoders(model_config: ReferenceConfig, device: torch.device) -> Any:
    vae = load_module(TinyVAE, model_config.path, "vae", device, torch.float32)
    text_encoder = load_module(ByteTextEncoder, model_config.path, "text_encoder", device, torch.float32)
    return vae.eval(), text_encoder.eval()


@hookimpl
def encode_batch(encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
    vae, text_encoder = encoders
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if batch.pixels is not None:
            out["latents"] = vae.encode(batch.pixels.to(vae.proj.weight.device, torch.float32))
            if batch.masks is not None:
                out["mask"] = torch.nn.functional.avg_pool2d(batch.masks.float(), vae.factor)
        if batch.captions is not None:
            out["text_embeds"] = text_encoder(batch.captions)
    return out


@hookimpl
def load_diffusion_model(model_config: ReferenceConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    return load_module(TinyDiT, model_config.path, "transformer", device, dtype)


@hookimpl
def diffusion_model_weights(model_config: ReferenceConfig):
    return [(model_config.path / "transformer.safetensors", lambda key: key)]


class EmbedLayer(nn.Module):
    def __init__(self, model: TinyDiT) -> None:
        super().__init__()
        self.x_embedder, self.t_embedder = model.x_embedder, model.t_embedder
        self.text_proj, self.pooled_proj = model.text_proj, model.pooled_proj
        self._embed = TinyDiT.embed.__get__(self)
        self.config = model.config

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, t, text = inputs
        dtype = self.x_embedder.weight.dtype
        tokens, c = self._embed(x.to(dtype), t, text.to(dtype))
        hw = torch.tensor(x.shape[2:], dtype=torch.long, device=x.device)
        return tokens, c, hw


class BlockLayer(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        tokens, c, hw = inputs
        return self.block(tokens, c), c, hw


class FinalLayer(nn.Module):
    def __init__(self, model: TinyDiT) -> None:
        super().__init__()
        self.norm_out, self.final_modulation, self.proj_out = model.norm_out, model.final_modulation, model.proj_out
        self._unembed = TinyDiT.unembed.__get__(self)
        self.config = model.config

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        tokens, c, hw = inputs
        return (self._unembed(tokens, c, int(hw[0]), int(hw[1])).float(),)


@hookimpl
def split_into_layers(model: TinyDiT, model_config: ReferenceConfig) -> list[nn.Module]:
    return [EmbedLayer(model), *(BlockLayer(b) for b in model.blocks), FinalLayer(model)]


@hookimpl
def prepare_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
    cfg: ReferenceConfig = context.model_config  # type: ignore[assignment]
    latents = batch["latents"].float()
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
def compute_loss(outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
    mask = targets[1] if len(targets) > 1 else None
    return masked_mse(outputs[0], targets[0], mask)


@hookimpl
def lora_targets(model_config: ReferenceConfig) -> list[str]:
    return ["to_q", "to_k", "to_v", "to_out", "fc1", "fc2"]


@hookimpl
def adapter_key_prefix() -> str:
    return "transformer"
