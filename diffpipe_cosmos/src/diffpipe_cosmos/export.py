"""Exports: LoRA in diffusers and ComfyUI layouts; full fine-tunes as a diffusers folder or an original single file.

ComfyUI (``CosmosVideo`` for 1.0, ``CosmosPredict2``) loads no diffusers/peft-layout key for Cosmos; it maps
``diffusion_model.<NVIDIA module name>`` with ``.lora_A.weight`` / ``.lora_B.weight`` and reads the strength only
from a scalar ``.alpha`` per module. Cosmos has no fused tensors, so each LoRA module is renamed through the
table of :mod:`diffpipe_cosmos.original`, nothing is combined.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from diffpipe_core.adapters import diffusers_format
from diffpipe_core.atomic import atomic_save_safetensors
from diffpipe_core.engine.saving import read_saved_model
from diffpipe_cosmos.original import Variant, count_blocks, diffusers_to_original, module_pairs

PREFIX = "transformer"
COMFY_PREFIX = "diffusion_model"
A, B = ".lora_A.weight", ".lora_B.weight"
SINGLE_FILES = {"1.0": "cosmos1-transformer.safetensors", "predict2": "cosmos-predict2-transformer.safetensors"}


def comfyui_format(state: dict[str, torch.Tensor], alpha: float, variant: Variant) -> dict[str, torch.Tensor]:
    """peft LoRA keys of the diffusers transformer -> ``diffusion_model.<original module>.lora_A/lora_B/.alpha``."""
    modules = sorted({k[: -len(A)] for k in state if k.endswith(A)})
    table = {d: n for n, d in module_pairs(variant, count_blocks(modules, r"transformer_blocks\.(\d+)\."))}
    unknown = [m for m in modules if m not in table]
    if unknown:
        raise ValueError(f"LoRA modules with no ComfyUI (NVIDIA-layout) counterpart: {unknown[:3]}")
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        key = f"{COMFY_PREFIX}.{table[module]}"
        out[f"{key}.lora_A.weight"] = state[module + A]
        out[f"{key}.lora_B.weight"] = state[module + B]
        out[f"{key}.alpha"] = torch.tensor(float(alpha))
    return out


def export_adapter(
    state: dict[str, torch.Tensor], alpha: float, format: str, variant: Variant
) -> dict[str, torch.Tensor] | None:
    """``diffusers``: the core's :func:`diffusers_format` (peft keys under ``transformer.``, config in the file's
    metadata); ``comfyui``: :func:`comfyui_format`; anything else: None."""
    if format == "diffusers":
        return diffusers_format(state, PREFIX)
    if format == "comfyui":
        return comfyui_format(state, alpha, variant)
    return None


def export_model(
    saved_dir: Path, transformer_config: Path, out_dir: Path, format: str, variant: Variant
) -> bool | None:
    """The core's saved shards (keys = diffusers parameter names) as ``diffusers``: a ``CosmosTransformer3DModel``
    folder (``config.json`` + ``diffusion_pytorch_model.safetensors``), or ``single_file``: one safetensors file in
    NVIDIA's layout (``net.`` keys, loadable as ``transformer_file``). Other formats: None."""
    if format not in ("diffusers", "single_file"):
        return None
    state = {k: v.contiguous() for k, v in read_saved_model(saved_dir).items()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if format == "diffusers":
        shutil.copyfile(transformer_config, out_dir / "config.json")
        atomic_save_safetensors(state, out_dir / "diffusion_pytorch_model.safetensors", {"format": "pt"})
    else:
        atomic_save_safetensors(
            diffusers_to_original(state, variant), out_dir / SINGLE_FILES[variant], {"format": "pt"}
        )
    return True
