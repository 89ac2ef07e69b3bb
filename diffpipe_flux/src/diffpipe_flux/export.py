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
from safetensors.torch import load_file

from diffpipe_core.adapters import diffusers_format
from diffpipe_core.atomic import atomic_save_safetensors
from diffpipe_flux.bfl import diffusers_to_bfl, module_pairs, swap_halves

PREFIX = "transformer"
COMFY_PREFIX = "diffusion_model"
A, B = ".lora_A.weight", ".lora_B.weight"
SAVED_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "flux1-transformer.safetensors"


def _count(modules: set[str], pattern: str) -> int:
    found = {int(m.group(1)) for k in modules if (m := re.match(pattern, k))}
    return max(found) + 1 if found else 0


def comfyui_format(state: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """peft LoRA keys of the diffusers transformer -> ComfyUI's BFL-native Flux LoRA keys (module docstring)."""
    modules = {k[: -len(A)] for k in state if k.endswith(A)}
    pairs = module_pairs(
        _count(modules, r"transformer_blocks\.(\d+)\."), _count(modules, r"single_transformer_blocks\.(\d+)\."), True
    )
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for pair in pairs:
        present = [p for p in pair.parts if p in modules]
        if not present:
            continue
        if pair.kind == "norm":
            raise ValueError(f"cannot export a LoRA on norm module {present[0]!r} to ComfyUI's format")
        done.update(present)
        key = f"{COMFY_PREFIX}.{pair.bfl}"
        if len(pair.parts) == 1:
            lora_b = state[present[0] + B]
            out[f"{key}.lora_A.weight"] = state[present[0] + A]
            out[f"{key}.lora_B.weight"] = swap_halves(lora_b) if pair.kind == "swap" else lora_b
            out[f"{key}.alpha"] = torch.tensor(float(alpha))
            continue
        dim = state[present[0] + A].shape[1]  # fused parts all read the block's inner dim
        sizes = [dim, dim, dim, 4 * dim] if pair.bfl.endswith("linear1") else [dim] * len(pair.parts)
        downs = [state[p + A] for p in present]
        ranks = [d.shape[0] for d in downs]
        up = torch.zeros(sum(sizes), sum(ranks), dtype=downs[0].dtype)
        row, col = 0, 0
        for part, size in zip(pair.parts, sizes):
            if part in modules:
                lora_b = state[part + B]
                if lora_b.shape[0] != size:
                    raise ValueError(f"{part}{B} has {lora_b.shape[0]} rows; the fused {pair.bfl} expects {size}")
                up[row : row + size, col : col + lora_b.shape[1]] = lora_b
                col += lora_b.shape[1]
            row += size
        out[f"{key}.lora_A.weight"] = torch.cat(downs, dim=0)
        out[f"{key}.lora_B.weight"] = up
        out[f"{key}.alpha"] = torch.tensor(float(alpha) * len(present))
    unknown = sorted(modules - done)
    if unknown:
        raise ValueError(f"LoRA modules with no ComfyUI (BFL) counterpart: {unknown[:3]}")
    return out


def export_adapter(state: dict[str, torch.Tensor], alpha: float, format: str) -> dict[str, torch.Tensor] | None:
    """``diffusers``: the core's :func:`diffusers_format` (peft keys under ``transformer.``; the core puts the
    LoRA config in the file's metadata); ``comfyui``: :func:`comfyui_format`; anything else: None."""
    if format == "diffusers":
        return diffusers_format(state, PREFIX)
    if format == "comfyui":
        return comfyui_format(state, alpha)
    return None


def read_saved_model(saved_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a full fine-tune the core saved (shards named by ``model.safetensors.index.json``)."""
    index = Path(saved_dir) / SAVED_INDEX
    if not index.is_file():
        raise FileNotFoundError(f"{index}: not found; expected a full fine-tune saved by diffpipe")
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        state.update(load_file(str(Path(saved_dir) / shard)))
    return state


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
