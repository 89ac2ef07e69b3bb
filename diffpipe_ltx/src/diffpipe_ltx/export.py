"""Exports: LoRA in diffusers and ComfyUI formats; full fine-tunes as a diffusers folder or an original single file.

ComfyUI format (what its LTXV loader applies; it loads no key of the diffusers/peft layout for LTX-Video):
``diffusion_model.<original Lightricks module name>.lora_A.weight``, ``.lora_B.weight`` and a scalar ``.alpha``
per module. The block linears keep their diffusers names (``transformer_blocks.0.attn1.to_q``, ``attn2.*``,
``ff.net.0.proj``, ``ff.net.2``); only ``proj_in`` -> ``patchify_proj`` and ``time_embed`` -> ``adaln_single``
are renamed (:mod:`diffpipe_ltx.lightricks`). No tensor is fused, so each module keeps its rank and alpha.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.adapters import diffusers_format, with_alpha
from diffpipe_core.atomic import atomic_save_safetensors
from diffpipe_core.engine.saving import read_saved_model
from diffpipe_ltx.config import LTXConfig
from diffpipe_ltx.lightricks import FILE_PREFIX, original_name, to_original

PREFIX = "transformer"
COMFY_PREFIX = "diffusion_model"
SINGLE_FILE = "ltxv-transformer.safetensors"
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def comfyui_format(state: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """peft LoRA keys of the diffusers transformer -> ComfyUI's LTXV keys (module docstring)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        suffix = next((s for s in LORA_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"LoRA key {key!r} is not a peft lora_A/lora_B weight; cannot export it to ComfyUI")
        out[f"{COMFY_PREFIX}.{original_name(key[: -len(suffix)])}{suffix}"] = value
    return with_alpha(out, alpha)


def export_adapter(state: dict[str, torch.Tensor], alpha: float, format: str) -> dict[str, torch.Tensor] | None:
    """``diffusers``: the core's :func:`diffusers_format` (peft keys under ``transformer.``; the core puts the LoRA
    config in the file's metadata); ``comfyui``: :func:`comfyui_format`; anything else: None."""
    if format == "diffusers":
        return diffusers_format(state, PREFIX)
    if format == "comfyui":
        return comfyui_format(state, alpha)
    return None


def export_model(saved_dir: Path, cfg: LTXConfig, out_dir: Path, format: str) -> bool | None:
    """Convert the core's saved shards (keys = diffusers parameter names) into ``out_dir``.

    ``diffusers``: an ``LTXVideoTransformer3DModel`` folder written by diffusers' ``save_pretrained`` (loads with
    ``from_pretrained``, or as ``path/transformer``). ``single_file``: ``ltxv-transformer.safetensors`` with the
    original Lightricks keys under ``model.diffusion_model.`` (loadable as ``transformer_file``, and by ComfyUI's
    diffusion-model loader). Other formats: None.
    """
    if format not in ("diffusers", "single_file"):
        return None
    state = {k: v.contiguous() for k, v in read_saved_model(saved_dir).items()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if format == "single_file":
        original = {FILE_PREFIX + k: v for k, v in to_original(state).items()}
        atomic_save_safetensors(original, out_dir / SINGLE_FILE, {"format": "pt"})
        return True
    from diffpipe_ltx.loading import build_transformer

    model = build_transformer(cfg, "meta", next(iter(state.values())).dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return True
