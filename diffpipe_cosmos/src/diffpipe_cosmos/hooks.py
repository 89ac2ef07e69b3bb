"""The hook implementations both Cosmos entry points share, bound to one generation (1.0 or Predict2).

Each entry-point module (:mod:`diffpipe_cosmos.cosmos1_plugin`, :mod:`diffpipe_cosmos.predict2_plugin`) holds one
:class:`CosmosHooks` instance, ``hooks``, which its entry point names (pluggy registers an instance's marked
methods like a module's functions). This module imports no torch, diffusers
or transformers at top level (``diffpipe models`` / ``validate`` load every plugin); each hook imports the modules
that do the work when it is called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core import ModelSpec, hookimpl
from diffpipe_cosmos.config import CosmosConfigBase

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core import EncodeBatch, TrainingContext
    from diffpipe_cosmos.encoding import CosmosEncoders
    from diffpipe_cosmos.original import Variant

#: Attention (self and cross) and MLP linears of every block; the adaLN modulation linears are left alone.
LORA_TARGETS = [
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out.0",
    "attn2.to_q",
    "attn2.to_k",
    "attn2.to_v",
    "attn2.to_out.0",
    "ff.net.0.proj",
    "ff.net.2",
]


@dataclass(frozen=True)
class Generation:
    """What differs between the two entry points."""

    variant: Variant
    spec: ModelSpec
    default_fps: float


class CosmosHooks:
    """The model hooks for one Cosmos generation."""

    def __init__(self, generation: Generation) -> None:
        self.gen = generation

    @property
    def variant(self) -> Variant:
        return self.gen.variant

    @hookimpl
    def model_spec(self) -> ModelSpec:
        """Video model (images are 1-frame clips); sizes in multiples of 16 (VAE 8 x patch 2)."""
        return self.gen.spec

    @hookimpl
    def validate_model_files(self, model_config: CosmosConfigBase) -> list[str]:
        """The diffusers Cosmos folder (pipeline, transformer, VAE, T5 and tokenizer classes, transformer weights)
        and the original single file's keys (this generation's layout), without reading weights."""
        from diffpipe_cosmos import files

        return files.problems(model_config, self.variant)

    @hookimpl
    def load_encoders(self, model_config: CosmosConfigBase, device: torch.device) -> Any:
        """The VAE and T5 with its tokenizer, from the diffusers folder."""
        from diffpipe_cosmos import encoding

        sigma_data = float(getattr(model_config, "sigma_data", 1.0))  # Predict2's pipelines scale by sigma_data 1
        return encoding.load_encoders(model_config, self.variant, sigma_data, device)

    @hookimpl
    def encode_batch(self, encoders: CosmosEncoders, batch: EncodeBatch) -> dict[str, torch.Tensor]:
        """Media: ``latents`` (B, C, T, H/8, W/8) normalised as the reference pipeline does, ``mask`` (B, 1, 1, h, w)
        on the latent grid when given. Captions: ``t5_embeds`` (B, t5_max_length, d), zero past each caption."""
        from diffpipe_cosmos import encoding

        out: dict[str, torch.Tensor] = {}
        if batch.pixels is not None:
            out["latents"] = encoding.encode_pixels(encoders, batch.pixels)
            if batch.masks is not None:
                out["mask"] = encoding.downsample_mask(batch.masks, tuple(out["latents"].shape[-2:]))
        if batch.captions is not None:
            out.update(encoding.encode_captions(encoders, batch.captions))
        return out

    @hookimpl
    def load_diffusion_model(
        self, model_config: CosmosConfigBase, device: torch.device, dtype: torch.dtype
    ) -> nn.Module:
        """The diffusers ``CosmosTransformer3DModel``; on ``meta`` a skeleton (float32-kept modules stay float32)
        whose weights :meth:`diffusion_model_weights` locates in either layout."""
        import torch

        from diffpipe_cosmos import loading

        if torch.device(device).type == "meta":
            return loading.build_transformer(model_config, "meta", dtype)
        return loading.load_transformer(model_config, self.variant, device, dtype)

    @hookimpl
    def diffusion_model_weights(self, model_config: CosmosConfigBase) -> list[tuple[Path, Callable[[str], str | None]]]:
        """Per-stage loading from the diffusers folder, or from the original file through its key renaming."""
        from diffpipe_cosmos import loading

        return loading.weight_sources(model_config, self.variant)

    @hookimpl
    def split_into_layers(self, model: nn.Module, model_config: CosmosConfigBase) -> list[nn.Module]:
        """Embedding (masks, RoPE, patch, timestep), each transformer block, final norm/projection."""
        from diffpipe_cosmos import layers

        return layers.split_into_layers(model, model_config.fps or self.gen.default_fps)

    @hookimpl
    def prepare_inputs(self, batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator):
        """1.0: EDM-preconditioned noisy latents; Predict2: rectified flow (see :mod:`diffpipe_cosmos.inputs`)."""
        from diffpipe_cosmos import inputs

        fn = inputs.cosmos1_inputs if self.variant == "1.0" else inputs.predict2_inputs
        return fn(batch, context, generator)

    @hookimpl
    def compute_loss(self, outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """1.0: EDM-weighted error of the denoised latent; Predict2: MSE to ``noise - latents`` (optionally
        t² + (1−t)² weighted). Mask-weighted when the dataset gives masks."""
        from diffpipe_cosmos import inputs

        fn = inputs.cosmos1_loss if self.variant == "1.0" else inputs.predict2_loss
        return fn(outputs, targets)

    @hookimpl
    def lora_targets(self, model_config: CosmosConfigBase) -> list[str]:
        """Self- and cross-attention q/k/v/out and the MLP linears of every block."""
        return list(LORA_TARGETS)

    @hookimpl
    def adapter_key_prefix(self) -> str:
        return "transformer"

    @hookimpl
    def export_adapter(self, state_dict: dict[str, torch.Tensor], alpha: float, rank: int, format: str):
        """``diffusers`` (peft keys under ``transformer.``) and ``comfyui`` (NVIDIA module names under
        ``diffusion_model.``, with ``.alpha``)."""
        from diffpipe_cosmos import export

        return export.export_adapter(state_dict, alpha, format, self.variant)

    @hookimpl
    def export_model(self, saved_dir: Path, model_config: CosmosConfigBase, out_dir: Path, format: str) -> bool | None:
        """``diffusers`` (a transformer folder) or ``single_file`` (NVIDIA's layout), from the core's saved shards."""
        from diffpipe_cosmos import export

        config = model_config.path / "transformer" / "config.json"
        return export.export_model(saved_dir, config, out_dir, format, self.variant)
