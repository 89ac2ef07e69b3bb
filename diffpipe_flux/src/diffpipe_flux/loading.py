"""Loading Flux from local files: the diffusers folder layout, or a BFL single-file transformer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from diffpipe_core.engine.model_loading import cast_skeleton
from diffpipe_core.model_files import diffusers_weight_files
from diffpipe_flux.bfl import bfl_key_map, bfl_to_diffusers
from diffpipe_flux.config import FluxConfig

TRANSFORMER = "transformer"


def transformer_config(cfg: FluxConfig) -> dict:
    """The transformer's diffusers config (``path/transformer/config.json``)."""
    file = cfg.path / TRANSFORMER / "config.json"
    if not file.is_file():
        raise FileNotFoundError(
            f"{file}: not found; [model] path must be a diffusers Flux folder with transformer/config.json "
            "(also needed with transformer_file, for the model's sizes)"
        )
    return json.loads(file.read_text())


def build_transformer(cfg: FluxConfig, device: torch.device | str, dtype: torch.dtype):
    """A ``FluxTransformer2DModel`` with the folder's config and uninitialised (or meta) weights."""
    from diffusers import FluxTransformer2DModel

    config = {k: v for k, v in transformer_config(cfg).items() if not k.startswith("_")}
    with torch.device(device):
        model = FluxTransformer2DModel.from_config(config)
    return cast_skeleton(model, dtype)


def folder_weight_files(cfg: FluxConfig) -> list[Path]:
    """The transformer's safetensors files in the diffusers folder (one file, or the shards of an index)."""
    return diffusers_weight_files(cfg.path / TRANSFORMER, "give transformer_file for a BFL single-file checkpoint")


def single_file_key_map(cfg: FluxConfig):
    """The key map of the BFL single file for per-stage loading, sized by the folder's transformer config."""
    config = transformer_config(cfg)
    return bfl_key_map(
        int(config.get("num_layers", 19)),
        int(config.get("num_single_layers", 38)),
        bool(config.get("guidance_embeds", False)),
        int(config.get("num_attention_heads", 24)) * int(config.get("attention_head_dim", 128)),
    )


def read_state_dict(cfg: FluxConfig) -> dict[str, torch.Tensor]:
    """The transformer weights in diffusers keys, from the BFL file if given, else from the folder."""
    if cfg.transformer_file is not None:
        return bfl_to_diffusers(load_file(str(cfg.transformer_file)), source=str(cfg.transformer_file))
    state: dict[str, torch.Tensor] = {}
    for file in folder_weight_files(cfg):
        state.update(load_file(str(file)))
    return state


def load_transformer(cfg: FluxConfig, device: torch.device | str, dtype: torch.dtype):
    """The full transformer with its weights. Unexpected or missing keys raise, naming the file and keys."""
    model = build_transformer(cfg, "meta", dtype)
    state = read_state_dict(cfg)
    source = cfg.transformer_file or cfg.path / TRANSFORMER
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if missing or unexpected:
        raise KeyError(
            f"{source}: weights do not fit the transformer config in {cfg.path / TRANSFORMER}: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})"
        )
    for key, value in state.items():
        if tuple(value.shape) != shapes[key]:
            raise ValueError(f"{source}: {key!r} has shape {tuple(value.shape)}, the config needs {shapes[key]}")
    model.load_state_dict({k: v.to(device, dtype) for k, v in state.items()}, assign=True)
    return model
