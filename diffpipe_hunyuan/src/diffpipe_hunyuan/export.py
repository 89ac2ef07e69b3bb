"""Exports: LoRA in diffusers and ComfyUI formats; full fine-tunes as a diffusers folder or an original-layout
single file.

ComfyUI format (the names ComfyUI's HunyuanVideo model gives its modules; ComfyUI maps no key of the
diffusers/peft layout for this model): ``diffusion_model.<native module>.lora_A.weight``, ``.lora_B.weight``
and a scalar ``.alpha`` per module. Where the native model fuses several diffusers linears into one
(``img_attn.qkv`` = to_q|to_k|to_v, ``txt_attn.qkv`` = add_q|k|v_proj, single blocks' ``linear1`` =
to_q|to_k|to_v|proj_mlp), the core's :func:`~diffpipe_core.adapters.fused_lora_format` combines the parts'
LoRAs exactly and scales ``.alpha`` with the number of parts (ComfyUI scales by alpha / rows(lora_A)).
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffpipe_core.adapters import FusedTarget, diffusers_format, fused_lora_format
from diffpipe_core.atomic import atomic_save_safetensors
from diffpipe_core.engine.saving import read_saved_model
from diffpipe_hunyuan.original import diffusers_to_original, maps_for_diffusers_keys

PREFIX = "transformer"
COMFY_PREFIX = "diffusion_model"
A, B = ".lora_A.weight", ".lora_B.weight"
SINGLE_FILE = "hunyuan_video_transformer.safetensors"


def part_rows(state: dict[str, torch.Tensor], parts: tuple[str, ...]) -> tuple[int, ...]:
    """Output rows of each part of a fused module. q, k and v have the block's width (every part's input
    size); a single block's MLP part has the rows of its LoRA, or HunyuanVideo's 4 x width when not adapted."""
    adapted = [p for p in parts if p + A in state]
    width = state[adapted[0] + A].shape[1]
    return tuple(
        (state[p + B].shape[0] if p + B in state else 4 * width) if p.endswith("proj_mlp") else width for p in parts
    )


def comfyui_format(state: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """peft LoRA keys of the diffusers transformer -> ComfyUI's native HunyuanVideo keys (module docstring).
    A LoRA on a module ComfyUI has no name for raises a ValueError naming it."""
    modules = [k[: -len(A)] for k in state if k.endswith(A)]
    targets = [
        FusedTarget(m.comfy, m.parts, part_rows(state, m.parts) if len(m.parts) > 1 else ())
        for m in maps_for_diffusers_keys(modules)
        if m.comfy is not None and any(p + A in state for p in m.parts)
    ]
    return fused_lora_format(state, alpha, targets, COMFY_PREFIX)


def export_adapter(state: dict[str, torch.Tensor], alpha: float, format: str) -> dict[str, torch.Tensor] | None:
    """``diffusers``: the core's :func:`diffusers_format` (peft keys under ``transformer.``; the core puts the
    LoRA config in the file's metadata); ``comfyui``: :func:`comfyui_format`; anything else: None."""
    if format == "diffusers":
        return diffusers_format(state, PREFIX)
    if format == "comfyui":
        return comfyui_format(state, alpha)
    return None


def export_model(saved_dir: Path, transformer_config: dict, out_dir: Path, format: str) -> bool | None:
    """Convert the core's saved shards (keys = diffusers parameter names) into ``out_dir``.

    ``diffusers``: a ``HunyuanVideoTransformer3DModel`` folder written by diffusers' ``save_pretrained`` (loadable
    with ``from_pretrained`` or as ``[model] path``'s ``transformer/``). ``single_file``:
    ``hunyuan_video_transformer.safetensors`` in the original Tencent key layout (loadable as
    ``transformer_file``, by diffusers' ``from_single_file`` and by ComfyUI). Other formats: None.
    """
    if format not in ("diffusers", "single_file"):
        return None
    state = {k: v.contiguous() for k, v in read_saved_model(saved_dir).items()}
    out_dir = Path(out_dir)
    if format == "single_file":
        atomic_save_safetensors(diffusers_to_original(state), out_dir / SINGLE_FILE, {"format": "pt"})
        return True
    from diffusers import HunyuanVideoTransformer3DModel

    config = {k: v for k, v in transformer_config.items() if not k.startswith("_")}
    with torch.device("meta"):
        model = HunyuanVideoTransformer3DModel.from_config(config)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise ValueError(f"{saved_dir}: the saved weights do not fit the transformer config: {exc}") from None
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return True
