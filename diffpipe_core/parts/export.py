"""Exports from a model's key table: LoRA in the diffusers and ComfyUI layouts, full fine-tunes as a diffusers
folder or an original-layout single file.

ComfyUI's loaders for most models (HunyuanVideo, LTX-Video, Cosmos; Flux through its BFL names) apply
``diffusion_model.<native module>.lora_A.weight`` / ``.lora_B.weight`` and read the strength only from a scalar
``.alpha`` per module. Where the native model fuses several diffusers linears into one, the parts' LoRAs are
combined exactly (:func:`diffpipe_core.adapters.fuse_lora`: ``lora_A`` rows stacked, ``lora_B`` block-diagonal,
``alpha`` times the number of adapted parts, because ComfyUI scales by alpha / rows(lora_A)).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from diffpipe_core.adapters import diffusers_format, fused_lora_format
from diffpipe_core.atomic import atomic_save_safetensors, atomic_write_text
from diffpipe_core.engine.saving import SAVED_INDEX, read_saved_model
from diffpipe_core.parts.layout import KeyTable, _swap_halves

A, B = ".lora_A.weight", ".lora_B.weight"
COMFY_PREFIX = "diffusion_model"


def lora_modules(state: dict[str, torch.Tensor]) -> list[str]:
    """The adapted module paths of a peft LoRA state dict; any other key (a DoRA ``lora_magnitude_vector``, ...)
    raises a ValueError naming it: no ecosystem layout below can carry it."""
    other = [k for k in state if not k.endswith((A, B))]
    if other:
        raise ValueError(f"LoRA key {other[0]!r} is not a peft lora_A/lora_B weight; it cannot be exported")
    return sorted(k[: -len(A)] for k in state if k.endswith(A))


def split_components(state: dict[str, Any], model: str, components: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """A diffusion model's state dict (or LoRA) by pipeline component: keys under a held component's name
    (``text_encoder.``; see :meth:`~diffpipe_core.parts.plugin.DiffusersModel.held_components`) without it, the
    model's own under ``model`` (``"unet"``)."""
    parts: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        part = next((c for c in components if c != model and key.startswith(c + ".")), model)
        parts.setdefault(part, {})[key if part == model else key[len(part) + 1 :]] = value
    return parts


def comfyui_lora(state: dict[str, torch.Tensor], alpha: float, layout: KeyTable) -> dict[str, torch.Tensor]:
    """peft LoRA keys of the diffusers model -> ``diffusion_model.<ComfyUI module>.lora_A/lora_B/.alpha`` through
    ``layout`` (fused where the native model fuses). A module ComfyUI has no name for raises a ValueError."""
    targets = layout.lora_targets(lora_modules(state))
    out = fused_lora_format(state, alpha, targets, COMFY_PREFIX)
    for entry in layout.modules:
        key = f"{COMFY_PREFIX}.{entry.comfy_name}{B}"
        if entry.swap and key in out:  # its rows are in the other order natively
            out[key] = _swap_halves(out[key])
    return out


def export_lora(
    state: dict[str, torch.Tensor], alpha: float, format: str, prefix: str, layout: KeyTable | None
) -> dict[str, torch.Tensor] | None:
    """``diffusers``: peft keys under the pipeline ``prefix`` (the LoRA config goes in the file's metadata);
    ``comfyui`` (with a ``layout``): :func:`comfyui_lora`; anything else: None (not this exporter's format)."""
    if format == "diffusers":
        return diffusers_format(state, prefix)
    if format == "comfyui" and layout is not None:
        return comfyui_lora(state, alpha, layout)
    return None


def export_diffusers_folder(saved_dir: Path, model_config: Mapping[str, Any], out_dir: Path) -> None:
    """The core's saved shards as a diffusers model folder: ``config.json`` (``model_config``: the trained model's) and
    ``diffusion_pytorch_model-0000k-of-0000n.safetensors`` with their index; ``from_pretrained(out_dir)`` loads it."""
    saved_dir, out_dir = Path(saved_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "config.json", json.dumps(dict(model_config), indent=2) + "\n")
    weight_map = json.loads((saved_dir / SAVED_INDEX).read_text())["weight_map"]
    renamed = {shard: "diffusion_pytorch_model" + shard[len("model") :] for shard in set(weight_map.values())}
    for shard, new in renamed.items():
        shutil.copyfile(saved_dir / shard, out_dir / new)
    index = {"metadata": {}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
    (out_dir / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def export_single_file(saved_dir: Path, layout: KeyTable, out_file: Path) -> None:
    """The core's saved shards as one safetensors file in the original layout (loadable as ``diffusion_model``)."""
    state = {k: v.contiguous() for k, v in read_saved_model(saved_dir).items()}
    atomic_save_safetensors(layout.to_original(state), Path(out_file), {"format": "pt"})
