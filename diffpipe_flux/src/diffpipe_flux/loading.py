"""Loading Flux from local files: the diffusers folder layout, or a BFL single-file transformer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from diffpipe_flux.bfl import bfl_to_diffusers
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
    return model if dtype == torch.float32 else model.to(dtype)


def folder_weight_files(cfg: FluxConfig) -> list[Path]:
    """The transformer's safetensors files in the diffusers folder (one file, or the shards of an index)."""
    folder = cfg.path / TRANSFORMER
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        return sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    single = folder / "diffusion_pytorch_model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(
            f"{folder}: no diffusion_pytorch_model.safetensors (or .index.json); give transformer_file for a "
            "BFL single-file checkpoint"
        )
    return [single]


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
