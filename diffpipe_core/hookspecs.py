"""The diffpipe plugin contract.

Every hook a plugin may implement is declared here. A model plugin is a module registered under the
entry-point group ``diffpipe.models``; the entry-point name is the model name. During a run the core
calls the hooks of the chosen model plugin only (``PluginManager.subset_hook_caller``), so an
implementation never has to ask "is this my model?". Generic plugins (loggers, optimizers, commands)
implement the non-model hooks and see every call.

Hooks marked *model* are called on the selected model plugin only; ``firstresult`` hooks return
the first non-None result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pluggy
import torch
from torch import nn

from diffpipe_core.types import EncodeBatch, ModelConfigBase, ModelSpec, TrainingContext

hookspec = pluggy.HookspecMarker("diffpipe")

Tensors = tuple[torch.Tensor, ...]


# ----------------------------------------------------------------------------------------- model
@hookspec(firstresult=True)
def model_spec() -> ModelSpec:
    """*model* Describe the model: name, image/video, latent geometry, and its ``[model]`` schema.

    Called before anything is loaded (``diffpipe models``, ``diffpipe validate``).
    """


@hookspec(firstresult=True)
def load_encoders(model_config: ModelConfigBase, device: torch.device) -> Any:
    """*model* Load the VAE and text encoders from local files onto ``device``.

    Returns an opaque object that is handed back to :func:`encode_batch`; the core drops it (and
    empties the device cache) before loading the diffusion model.
    """


@hookspec(firstresult=True)
def encode_batch(encoders: Any, batch: EncodeBatch) -> dict[str, torch.Tensor]:
    """*model* Encode one batch for the cache; called on every rank for its own shard.

    A media batch (``batch.pixels`` set) returns latents and anything derived from the pixels
    (e.g. ``"latents"``, ``"time_ids"``); a caption batch (``batch.captions`` set) returns text
    tensors (e.g. ``"text_embeds"``, ``"pooled"``, ``"text_mask"``). Every tensor has the batch as
    its first dimension; the core stores each sample's slice. Keys must not start with ``_``.
    """


@hookspec(firstresult=True)
def load_diffusion_model(model_config: ModelConfigBase, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """*model* Build the diffusion model from local files (a diffusers folder or a single file).

    ``device`` may be ``torch.device("meta")``: the plugin then returns the module skeleton without
    reading weights, and :func:`diffusion_model_weights` tells the core where to find them, so each
    pipeline stage can fill in only its own layers.
    """


@hookspec(firstresult=True)
def diffusion_model_weights(model_config: ModelConfigBase) -> list[tuple[Path, Callable[[str], str | None]]]:
    """*model, optional* Where the weights of a meta-built model live, for per-stage loading.

    Returns ``(safetensors_file, key_map)`` pairs; ``key_map`` turns a file key into the model's
    ``state_dict`` key (or None to skip it). Plugins that do not implement it are loaded whole.
    """


@hookspec(firstresult=True)
def split_into_layers(model: nn.Module, model_config: ModelConfigBase) -> list[nn.Module]:
    """*model* Cut the diffusion model into an ordered list of pipeline layers.

    Each layer is an ``nn.Module`` whose ``forward`` takes one tuple of tensors and returns one tuple
    of tensors; the first layer receives what :func:`prepare_inputs` returned as inputs. Float
    tensors that cross a layer boundary must be used downstream. The layers must share parameters
    with ``model`` (wrap its submodules; don't copy them) so that adapters and exports see one model.
    """


@hookspec(firstresult=True)
def prepare_inputs(
    batch: dict[str, torch.Tensor], context: TrainingContext, generator: torch.Generator
) -> tuple[Tensors, Tensors]:
    """*model* Turn one collated cached micro-batch into ``(model_inputs, loss_targets)``.

    Draw all randomness (noise, timesteps) from ``generator``: the core seeds it per step and
    micro-batch so that the first and last pipeline stages, which both call this hook, agree.
    ``model_inputs`` feed the first layer; ``loss_targets`` reach :func:`compute_loss`.
    Timestep sampling and flow-matching targets are in :mod:`diffpipe_core.diffusion`.
    """


@hookspec(firstresult=True)
def compute_loss(outputs: Tensors, targets: Tensors) -> torch.Tensor:
    """*model* Scalar loss from the last layer's outputs and :func:`prepare_inputs`' targets.

    Runs on the last pipeline stage for every micro-batch.
    """


@hookspec(firstresult=True)
def lora_targets(model_config: ModelConfigBase) -> list[str]:
    """*model* Module names (regex suffixes accepted by peft's ``target_modules``) to adapt with LoRA.

    The user's ``[adapter] target_modules`` overrides this list.
    """


@hookspec(firstresult=True)
def export_adapter(
    state_dict: dict[str, torch.Tensor], alpha: float, rank: int, format: str
) -> dict[str, torch.Tensor] | None:
    """*model, optional* Rewrite a peft LoRA state dict (keys relative to the diffusion model, e.g.
    ``blocks.0.attn.to_q.lora_A.weight``) into an ecosystem format.

    ``format`` is ``"diffusers"``, ``"comfyui"``, ``"kohya"`` or a plugin-specific name from
    ``[adapter] save_formats``. Return None for a format the plugin does not know. Without an
    implementation the core writes diffusers/peft keys (``<prefix>.<key>``) with ``.alpha`` tensors.
    """


@hookspec(firstresult=True)
def adapter_key_prefix() -> str:
    """*model, optional* The prefix of the diffusion model in its diffusers pipeline
    (``"transformer"`` or ``"unet"``); used for the default diffusers-format LoRA. Default
    ``"transformer"``."""


@hookspec(firstresult=True)
def export_model(saved_dir: Path, model_config: ModelConfigBase, out_dir: Path, format: str) -> bool | None:
    """*model, optional* Convert a saved full fine-tune into an ecosystem ``format`` under ``out_dir``.

    ``saved_dir`` holds what the core wrote: ``model-0000k-of-0000n.safetensors`` shards keyed by the
    diffusion model's ``state_dict`` names, one per pipeline stage, plus ``model.safetensors.index.json``.
    Called on rank 0 after every full-model save, once per entry of the run's ``save_model_formats``
    (e.g. ``"diffusers"``, ``"single_file"``). Return True when written, None for an unknown format.
    """


@hookspec(firstresult=True)
def sample(model: nn.Module, encoders: Any, prompts: Sequence[str], model_config: ModelConfigBase) -> Any:
    """*model, optional* Generate samples during training (images or videos as uint8 tensors)."""


# ---------------------------------------------------------------------------------------- generic
@hookspec
def register_commands(cli: Any) -> None:
    """Add click commands to the ``diffpipe`` CLI group."""


@hookspec
def register_optimizers(register: Callable[[str, Callable[..., torch.optim.Optimizer]], None]) -> None:
    """Offer optimizers by name: ``register("lion", lambda params, **kw: Lion(params, **kw))``."""


@hookspec
def on_train_step_end(step: int, metrics: dict[str, float]) -> None:
    """Observe the metrics of a finished optimizer step (rank 0 only)."""


@hookspec
def on_train_end(run_dir: Path, summary: dict[str, Any]) -> None:
    """Observe the end of a training run (rank 0 only)."""
