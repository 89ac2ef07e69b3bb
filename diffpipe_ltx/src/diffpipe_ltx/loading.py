"""Loading LTX-Video from local files: the diffusers folder layout, or an original-layout single file
(transformer) with the other components from the folder. Both layouts load per stage: the original names
differ from diffusers' only by renames, so each rank reads just its own tensors from either file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from diffpipe_core.model_files import diffusers_weight_files
from diffpipe_ltx.config import LTXConfig
from diffpipe_ltx.lightricks import key_map_for

TRANSFORMER = "transformer"
FRAME_RATE = 25  # LTXPipeline's default frame_rate; videos are resampled to it (ModelSpec.video_fps)


def _json(file: Path, what: str) -> dict[str, Any]:
    if not file.is_file():
        raise FileNotFoundError(f"{file}: not found; [model] path must be a diffusers LTX-Video folder with {what}")
    return json.loads(file.read_text())


def transformer_config(cfg: LTXConfig) -> dict[str, Any]:
    """The transformer's diffusers config (``path/transformer/config.json``; needed with transformer_file too)."""
    return _json(cfg.path / TRANSFORMER / "config.json", "transformer/config.json")


def vae_compression(cfg: LTXConfig) -> tuple[int, int]:
    """``(temporal, spatial)`` compression of the VAE, computed as ``AutoencoderKLLTXVideo`` does."""
    vae = _json(cfg.path / "vae" / "config.json", "vae/config.json")
    levels = sum(bool(s) for s in vae.get("spatio_temporal_scaling", (True, True, True, False)))
    spatial = vae.get("spatial_compression_ratio") or vae.get("patch_size", 4) * 2**levels
    temporal = vae.get("temporal_compression_ratio") or vae.get("patch_size_t", 1) * 2**levels
    return int(temporal), int(spatial)


def rope_interpolation_scale(cfg: LTXConfig) -> tuple[float, float, float]:
    """LTXPipeline's ``(vae_temporal / frame_rate, vae_spatial, vae_spatial)``."""
    temporal, spatial = vae_compression(cfg)
    return (temporal / FRAME_RATE, float(spatial), float(spatial))


def shift_constants(cfg: LTXConfig) -> tuple[int, int, float, float]:
    """``(base_seq_len, max_seq_len, base_shift, max_shift)`` from the scheduler config, with LTXPipeline's
    defaults for any that are missing."""
    file = cfg.path / "scheduler" / "scheduler_config.json"
    sched = json.loads(file.read_text()) if file.is_file() else {}
    return (
        int(sched.get("base_image_seq_len", 256)),
        int(sched.get("max_image_seq_len", 4096)),
        float(sched.get("base_shift", 0.5)),
        float(sched.get("max_shift", 1.15)),
    )


def build_transformer(cfg: LTXConfig, device: torch.device | str, dtype: torch.dtype):
    """An ``LTXVideoTransformer3DModel`` with the folder's config and uninitialised (or meta) weights."""
    from diffusers import LTXVideoTransformer3DModel

    from diffpipe_core.engine.model_loading import cast_skeleton

    config = {k: v for k, v in transformer_config(cfg).items() if not k.startswith("_")}
    patches = (config.get("patch_size", 1), config.get("patch_size_t", 1))
    if patches != (1, 1):
        raise ValueError(
            f"{cfg.path / TRANSFORMER / 'config.json'}: patch_size {patches[0]}, patch_size_t {patches[1]}; "
            "diffpipe-ltx supports the released LTX-Video transformers (patch sizes 1)"
        )
    with torch.device(device):
        model = LTXVideoTransformer3DModel.from_config(config)
    return cast_skeleton(model, dtype)


def folder_weight_files(cfg: LTXConfig) -> list[Path]:
    """The transformer's safetensors files in the diffusers folder (one file, or the shards of an index)."""
    return diffusers_weight_files(cfg.path / TRANSFORMER, "give transformer_file for an original-layout single file")


def file_keys(file: Path) -> list[str]:
    """The tensor names in a safetensors file (its header only)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise ValueError(f"{file}: not a readable safetensors file ({exc})") from None


def weight_sources(cfg: LTXConfig) -> list[tuple[Path, Callable[[str], str | None]]]:
    """``(file, key -> diffusers name)`` for the transformer weights of either layout."""
    if cfg.transformer_file is not None:
        if not cfg.transformer_file.is_file():
            raise FileNotFoundError(f"{cfg.transformer_file}: transformer_file not found")
        return [(cfg.transformer_file, key_map_for(file_keys(cfg.transformer_file)))]
    return [(file, lambda key: key) for file in folder_weight_files(cfg)]


def load_transformer(cfg: LTXConfig, device: torch.device | str, dtype: torch.dtype):
    """The full transformer with its weights. Missing, unexpected or misshapen tensors raise, naming the file."""
    model = build_transformer(cfg, "meta", dtype)
    skeleton = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in skeleton.items()}
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file, key_map in weight_sources(cfg):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = key_map(key)
                if name is None:
                    continue
                if name not in shapes:
                    unexpected.append(key)
                    continue
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != shapes[name]:
                    raise ValueError(
                        f"{file}: {key!r} has shape {tuple(tensor.shape)}, the config needs {shapes[name]}"
                    )
                state[name] = tensor.to(device, skeleton[name].dtype)
    source = cfg.transformer_file or cfg.path / TRANSFORMER
    missing = sorted(set(shapes) - set(state))
    if missing or unexpected:
        raise KeyError(
            f"{source}: weights do not fit the transformer config in {cfg.path / TRANSFORMER}: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {sorted(unexpected)[:3]})"
        )
    model.load_state_dict(state, assign=True)
    return model
