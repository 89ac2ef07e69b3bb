"""Hook implementations of the reference model (entry point ``reference``).

Like every model plugin, this module, ``model_spec`` and the config schema import no torch: the hooks import
the model code when they are called.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from diffpipe_core import ModelConfigBase, ModelSpec, hookimpl

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_core.types import SampleRequest
    from diffpipe_reference.model import TinyDiT


class ReferenceConfig(ModelConfigBase):
    """``[model]`` keys of the reference model."""

    path: Path = Field(description="Folder written by diffpipe_reference.model.write_tiny_model.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Base weight dtype.")
    timestep_sample_method: Literal["logit_normal", "uniform"] = Field("logit_normal", description="t sampling.")
    sigmoid_scale: float = Field(1.0, gt=0, description="Scale of the logit-normal distribution.")
    shift: float = Field(1.0, gt=0, description="Time shift applied after sampling.")


#: python -m diffpipe_core.testing.tiny_models reference DIR
tiny_writer = "diffpipe_reference.model:write_tiny_model"

SPEC = ModelSpec(
    name="reference",
    modality="image",
    config_schema=ReferenceConfig,
    spatial_multiple=16,
    encoder_settings=("path",),
    block_layers=("BlockLayer",),
    description="Tiny pure-PyTorch DiT for tests and the demo",
)


@hookimpl
def model_spec() -> ModelSpec:
    return SPEC


@hookimpl
def validate_model_files(model_config: ReferenceConfig) -> list[str]:
    """config.json with the TinyDiT keys and the three safetensors files, without reading weights."""
    from dataclasses import fields

    from diffpipe_core.model_files import read_json, safetensors_keys
    from diffpipe_reference.model import TinyDiTConfig

    folder = model_config.path
    if not folder.is_dir():
        return [f"{folder}: not a folder; expected a reference model folder (config.json, transformer.safetensors, "
                "vae.safetensors, text_encoder.safetensors)"]
    problems = []
    data, problem = read_json(folder / "config.json")
    known = {f.name for f in fields(TinyDiTConfig)}
    if problem:
        problems.append(f"{problem}; expected the reference model's config")
    elif set(data) - known:
        problems.append(f"{folder / 'config.json'}: keys {sorted(set(data) - known)} are not reference model keys; "
                        f"expected {sorted(known)}")
    for name in ("transformer", "vae", "text_encoder"):
        _, problem = safetensors_keys(folder / f"{name}.safetensors")
        if problem:
            problems.append(f"{problem}; expected the {name} weights")
    return problems


@hookimpl
def load_encoders(model_config: ReferenceConfig, device: torch.device) -> Any:
    import torch

    from diffpipe_reference.model import ByteTextEncoder, TinyVAE, load_module

    vae = load_module(TinyVAE, model_config.path, "vae", device, torch.float32)
    text_encoder = load_module(ByteTextEncoder, model_config.path, "text_encoder", device, torch.float32)
    return vae.eval(), text_encoder.eval()


@hookimpl
def encode_batch(encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
    import torch

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
    from diffpipe_reference.model import TinyDiT, load_module

    return load_module(TinyDiT, model_config.path, "transformer", device, dtype)


@hookimpl
def diffusion_model_weights(model_config: ReferenceConfig):
    return [(model_config.path / "transformer.safetensors", lambda key: key)]


@hookimpl
def split_into_layers(model: TinyDiT, model_config: ReferenceConfig) -> list[nn.Module]:
    from diffpipe_reference.layers import split_into_layers

    return split_into_layers(model)


@hookimpl
def prepare_inputs(batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
    from diffpipe_core.parts.flow import flow_sample

    cfg: ReferenceConfig = context.model_config  # type: ignore[assignment]
    s = flow_sample(batch["latents"], cfg, context, generator, time_range=(0.0, 1.0))  # type: ignore[arg-type]
    targets = (s.target, batch["mask"]) if "mask" in batch else (s.target,)
    return (s.x_t, s.t, batch["text_embeds"].float()), targets


@hookimpl
def compute_loss(
    outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...], context: TrainingContext
) -> torch.Tensor:
    from diffpipe_core.diffusion import training_loss

    # the run's loss (squared error, or pseudo_huber_c / huber_delta / smooth_l1_beta), mask-weighted
    return training_loss(outputs[0], targets[0], targets[1] if len(targets) > 1 else None, context)


@hookimpl
def denoise_init(request: SampleRequest, model_config: ReferenceConfig, generator: torch.Generator):
    """Noise ``(1, C, H/8, W/8)`` and flow-matching sigmas 1 .. 0 shifted by ``[model] shift``."""
    import torch

    from diffpipe_core.sampling.schedules import flow_sigmas
    from diffpipe_reference.model import read_config

    config = read_config(model_config.path)
    f = config.vae_factor
    latents = torch.randn((1, config.in_channels, request.height // f, request.width // f), generator=generator)
    return latents, flow_sigmas(request.steps, model_config.shift)


@hookimpl
def denoise_inputs(latents, schedule, index, text, request, model_config):
    """``(x_t, t, text_embeds)``, the layout :func:`prepare_inputs` gives the first layer."""
    t = schedule[index].float().expand(latents.shape[0])
    return latents.float(), t, text["text_embeds"].float()


@hookimpl
def denoise_step(latents, prediction, schedule, index, model_config):
    """Flow-matching Euler step (the model predicts the velocity ``noise - x``)."""
    from diffpipe_core.sampling.schedules import flow_euler_step

    return flow_euler_step(latents, prediction, schedule, index)


@hookimpl
def load_decoder(model_config: ReferenceConfig, device: torch.device) -> Any:
    import torch

    from diffpipe_reference.model import TinyVAE, load_module

    return load_module(TinyVAE, model_config.path, "vae", device, torch.float32).eval()


@hookimpl
def decode_latents(decoder: Any, latents: torch.Tensor) -> torch.Tensor:
    return decoder.decode(latents.to(decoder.proj.weight.device))


@hookimpl
def lora_targets(model_config: ReferenceConfig) -> list[str]:
    return ["to_q", "to_k", "to_v", "to_out", "fc1", "fc2"]


@hookimpl
def adapter_key_prefix() -> str:
    return "transformer"


@hookimpl
def parameter_groups(model_config: ReferenceConfig) -> dict[str, list[str]]:
    """Per-component learning rates: ``attention`` (the blocks' q/k/v/out) and ``mlp`` (everything else)."""
    return {"mlp": [], "attention": [r"blocks\.\d+\.attn\."]}
