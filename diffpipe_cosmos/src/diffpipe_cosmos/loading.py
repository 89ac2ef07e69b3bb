"""Loading the Cosmos transformer from local files: the diffusers folder, or an original NVIDIA single file.

Both layouts are read per stage: an original file is a pure renaming of the diffusers keys
(:mod:`diffpipe_cosmos.original`), so each stage reads only its own tensors from either.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from diffpipe_core.engine.model_loading import cast_skeleton
from diffpipe_core.model_files import diffusers_weight_files
from diffpipe_cosmos.config import CosmosConfigBase
from diffpipe_cosmos.original import NET, TRAINING_ONLY, Variant, module_pairs, original_to_diffusers

TRANSFORMER = "transformer"


def transformer_config(cfg: CosmosConfigBase) -> dict:
    """The transformer's diffusers config (``path/transformer/config.json``)."""
    file = cfg.path / TRANSFORMER / "config.json"
    if not file.is_file():
        raise FileNotFoundError(
            f"{file}: not found; [model] path must be a diffusers Cosmos folder with transformer/config.json "
            "(also needed with transformer_file, for the model's sizes)"
        )
    return json.loads(file.read_text())


def build_transformer(cfg: CosmosConfigBase, device: torch.device | str, dtype: torch.dtype):
    """A ``CosmosTransformer3DModel`` with the folder's config and uninitialised (or meta) weights, in ``dtype``
    except diffusers' ``_keep_in_fp32_modules`` (the learnable position embedding), as from_pretrained does."""
    from diffusers import CosmosTransformer3DModel

    config = {k: v for k, v in transformer_config(cfg).items() if not k.startswith("_")}
    with torch.device(device):
        model = CosmosTransformer3DModel.from_config(config)
    return cast_skeleton(model, dtype)


def folder_weight_files(cfg: CosmosConfigBase) -> list[Path]:
    """The transformer's safetensors files in the diffusers folder (one file, or the shards of an index)."""
    hint = "give transformer_file for an original NVIDIA single-file checkpoint"
    return diffusers_weight_files(cfg.path / TRANSFORMER, hint)


def original_key_map(variant: Variant, num_layers: int) -> Callable[[str], str | None]:
    """Original file key -> diffusers ``state_dict`` key (None for training-only tensors and unknown keys)."""
    table = dict(module_pairs(variant, num_layers))

    def key_map(key: str) -> str | None:
        bare = key[len(NET) :] if key.startswith(NET) else key
        if TRAINING_ONLY.search(bare):
            return None
        module, _, param = bare.rpartition(".")
        return f"{table[module]}.{param}" if module in table else None

    return key_map


def weight_sources(cfg: CosmosConfigBase, variant: Variant) -> list[tuple[Path, Callable[[str], str | None]]]:
    """``(file, key_map)`` pairs for per-stage loading, from either layout."""
    if cfg.transformer_file is not None:
        layers = int(transformer_config(cfg).get("num_layers", 0))
        return [(cfg.transformer_file, original_key_map(variant, layers))]
    return [(file, lambda key: key) for file in folder_weight_files(cfg)]


def read_state_dict(cfg: CosmosConfigBase, variant: Variant) -> dict[str, torch.Tensor]:
    """The transformer weights in diffusers keys, from the original file if given, else from the folder."""
    if cfg.transformer_file is not None:
        with safe_open(str(cfg.transformer_file), framework="pt") as f:
            raw = {k: f.get_tensor(k) for k in f.keys()}
        return original_to_diffusers(raw, variant, source=str(cfg.transformer_file))
    state: dict[str, torch.Tensor] = {}
    for file in folder_weight_files(cfg):
        with safe_open(str(file), framework="pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys()})
    return state


def load_transformer(cfg: CosmosConfigBase, variant: Variant, device: torch.device | str, dtype: torch.dtype):
    """The full transformer with its weights. Unexpected or missing keys raise, naming the file and keys."""
    model = build_transformer(cfg, "meta", dtype)
    state = read_state_dict(cfg, variant)
    source = cfg.transformer_file or cfg.path / TRANSFORMER
    current = model.state_dict()
    missing, unexpected = sorted(set(current) - set(state)), sorted(set(state) - set(current))
    if missing or unexpected:
        raise KeyError(
            f"{source}: weights do not fit the transformer config in {cfg.path / TRANSFORMER}: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})"
        )
    for key, value in state.items():
        if tuple(value.shape) != tuple(current[key].shape):
            raise ValueError(
                f"{source}: {key!r} has shape {tuple(value.shape)}, the config needs {tuple(current[key].shape)}"
            )
    model.load_state_dict({k: v.to(device, current[k].dtype) for k, v in state.items()}, assign=True)
    return model
