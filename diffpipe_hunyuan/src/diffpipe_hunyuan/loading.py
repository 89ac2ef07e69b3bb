"""Loading HunyuanVideo from local files: the diffusers folder layout, or an original-layout single file."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diffpipe_core.engine.model_loading import cast_skeleton
from diffpipe_core.model_files import diffusers_weight_files
from diffpipe_hunyuan.config import HunyuanConfig
from diffpipe_hunyuan.original import original_to_diffusers

TRANSFORMER = "transformer"


def transformer_config(cfg: HunyuanConfig) -> dict:
    """The transformer's diffusers config (``path/transformer/config.json``)."""
    file = cfg.path / TRANSFORMER / "config.json"
    if not file.is_file():
        raise FileNotFoundError(
            f"{file}: not found; [model] path must be a diffusers HunyuanVideo folder with transformer/config.json "
            "(also needed with transformer_file, for the model's sizes)"
        )
    return json.loads(file.read_text())


def build_transformer(cfg: HunyuanConfig, device: torch.device | str, dtype: torch.dtype):
    """A ``HunyuanVideoTransformer3DModel`` with the folder's config and uninitialised (or meta) weights, cast the
    way ``from_pretrained(torch_dtype=dtype)`` casts it."""
    from diffusers import HunyuanVideoTransformer3DModel

    config = {k: v for k, v in transformer_config(cfg).items() if not k.startswith("_")}
    with torch.device(device):
        model = HunyuanVideoTransformer3DModel.from_config(config)
    return cast_skeleton(model, dtype)


def folder_weight_files(cfg: HunyuanConfig) -> list[Path]:
    """The transformer's safetensors files in the diffusers folder: the shards its index names, or one file."""
    return diffusers_weight_files(cfg.path / TRANSFORMER, "give transformer_file for an original-layout single file")


def load_single_file(cfg: HunyuanConfig, device: torch.device | str, dtype: torch.dtype):
    """The transformer with the weights of ``transformer_file`` (converted from the original layout).
    Missing, unexpected or misshapen tensors raise, naming the file and the keys."""
    from safetensors.torch import load_file

    assert cfg.transformer_file is not None
    source = cfg.transformer_file
    state = original_to_diffusers(load_file(str(source)), source=str(source))
    model = build_transformer(cfg, "meta", dtype)
    try:
        model.load_state_dict({k: v.to(device, dtype) for k, v in state.items()}, strict=True, assign=True)
    except RuntimeError as exc:  # torch lists the missing, unexpected and misshapen keys
        raise ValueError(
            f"{source}: weights do not fit the transformer config in {cfg.path / TRANSFORMER}: {exc}"
        ) from None
    return model


def load_transformer(cfg: HunyuanConfig, device: torch.device | str, dtype: torch.dtype):
    """The whole transformer with its weights, from ``transformer_file`` or with diffusers' ``from_pretrained``."""
    if cfg.transformer_file is not None:
        return load_single_file(cfg, device, dtype)
    from diffusers import HunyuanVideoTransformer3DModel

    folder = cfg.path / TRANSFORMER
    transformer_config(cfg), folder_weight_files(cfg)  # clear errors for a missing config or missing weights
    model = HunyuanVideoTransformer3DModel.from_pretrained(str(folder), torch_dtype=dtype, local_files_only=True)
    return model.to(device)
