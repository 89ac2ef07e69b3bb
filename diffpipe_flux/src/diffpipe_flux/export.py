"""Exports: LoRA in diffusers and ComfyUI formats; full fine-tunes as a diffusers folder or a BFL single file.

ComfyUI format (BFL-native keys, as ComfyUI's Flux loader applies them to the original weights):
``diffusion_model.<bfl module>.lora_A.weight``, ``.lora_B.weight`` and a scalar ``.alpha`` per module.
Where BFL fuses several diffusers linears into one (``img_attn.qkv`` = to_q|to_k|to_v, ``txt_attn.qkv``
= add_q|k|v_proj, single blocks' ``linear1`` = to_q|to_k|to_v|proj_mlp), the parts' LoRAs are combined
exactly: ``lora_A`` rows stacked, ``lora_B`` block-diagonal (zero rows for a part without LoRA), and
``alpha`` multiplied by the number of parts, because ComfyUI scales by ``alpha / rows(lora_A)``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from diffpipe_core.adapters import FusedTarget, diffusers_format, fused_lora_format
from diffpipe_core.atomic import atomic_save_safetensors
from diffpipe_core.engine.saving import SAVED_INDEX, read_saved_model
from diffpipe_flux.bfl import diffusers_to_bfl, module_pairs, swap_halves

PREFIX = "transformer"
COMFY_PREFIX = "diffusion_model"
A, B = ".lora_A.weight", ".lora_B.weight"
SINGLE_FILE = "flux1-transformer.safetensors"


def _count(modules: set[str], pattern: str) -> int:
    found = {int(m.group(1)) for k in modules if (m := re.match(pattern, k))}
    return max(found) + 1 if found else 0


def comfyui_format(state: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """peft LoRA keys of the diffusers transformer -> ComfyUI's BFL-native Flux LoRA keys (module docstring);
    the fusing is the core's :func:`fused_lora_format`."""
    modules = {k[: -len(A)] for k in state if k.endswith(A)}
    pairs = module_pairs(
        _count(modules, r"transformer_blocks\.(\d+)\."), _count(modules, r"single_transformer_blocks\.(\d+)\."), True
    )
    targets = []
    for pair in pairs:
        present = [p for p in pair.parts if p in modules]
        if not present:
            continue
        if pair.kind == "norm":
            raise ValueError(f"cannot export a LoRA on norm module {present[0]!r} to ComfyUI's format")
        dim = state[present[0] + A].shape[1]  # fused parts all read the block's inner dim
        sizes = (dim, dim, dim, 4 * dim) if pair.bfl.endswith("linear1") else (dim,) * len(pair.parts)
        targets.append(FusedTarget(pair.bfl, pair.parts, sizes if len(pair.parts) > 1 else ()))
    out = fused_lora_format(state, alpha, targets, COMFY_PREFIX)
    for pair in pairs:
        key = f"{COMFY_PREFIX}.{pair.bfl}.lora_B.weight"
        if pair.kind == "swap" and key in out:
            out[key] = swap_halves(out[key])
    return out


def adapter_key_names(modules: list[str], format: str) -> dict[str, str] | None:
    """Key stems of a LoKr/LoHa: ``comfyui`` keeps the diffusers names under ``transformer.``, which ComfyUI's Flux
    key map sends into the BFL weights (into their slice of a fused ``qkv``/``linear1``; the final adaLN with its
    halves swapped), because a Kronecker or Hadamard update cannot be fused like a LoRA. Other formats: None."""
    if format != "comfyui":
        return None
    names = set(modules)
    pairs = module_pairs(
        _count(names, r"transformer_blocks\.(\d+)\."), _count(names, r"single_transformer_blocks\.(\d+)\."), True
    )
    known = {part for pair in pairs if pair.kind != "norm" for part in pair.parts}
    unknown = sorted(names - known)
    if unknown:
        raise ValueError(f"modules with no ComfyUI (BFL-layout) counterpart: {unknown[:3]}")
    return {m: f"{PREFIX}.{m}" for m in modules}


def export_adapter(state: dict[str, torch.Tensor], alpha: float, format: str) -> dict[str, torch.Tensor] | None:
    """``diffusers``: the core's :func:`diffusers_format` (peft keys under ``transformer.``; the core puts the
    LoRA config in the file's metadata); ``comfyui``: :func:`comfyui_format`; anything else: None."""
    if format == "diffusers":
        return diffusers_format(state, PREFIX)
    if format == "comfyui":
        return comfyui_format(state, alpha)
    return None


def export_model(saved_dir: Path, transformer_config: Path, out_dir: Path, format: str) -> bool | None:
    """Convert the core's saved shards (keys = diffusers parameter names) into ``out_dir``.

    ``diffusers``: a ``FluxTransformer2DModel`` folder (``config.json`` copied from ``transformer_config``, the
    shards copied as ``diffusion_pytorch_model-0000k-of-0000n.safetensors`` with their index), loadable with
    ``FluxTransformer2DModel.from_pretrained(out_dir)``. ``single_file``: ``flux1-transformer.safetensors`` in the
    original BFL key layout. Other formats: None.
    """
    saved_dir, out_dir = Path(saved_dir), Path(out_dir)
    if format == "diffusers":
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(transformer_config, out_dir / "config.json")
        weight_map = json.loads((saved_dir / SAVED_INDEX).read_text())["weight_map"]
        renamed = {shard: "diffusion_pytorch_model" + shard[len("model") :] for shard in set(weight_map.values())}
        for shard, new in renamed.items():
            shutil.copyfile(saved_dir / shard, out_dir / new)
        index = {"metadata": {}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
        (out_dir / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return True
    if format == "single_file":
        state = {k: v.contiguous() for k, v in read_saved_model(saved_dir).items()}
        atomic_save_safetensors(diffusers_to_bfl(state), out_dir / SINGLE_FILE, {"format": "pt"})
        return True
    return None
