"""``[model] merge_adapters``: LoRAs merged into the frozen base weights as each pipeline stage loads.

Each file's keys are read in any layout diffpipe writes: diffusers (peft keys under the pipeline prefix, the
strength in the ``lora_adapter_metadata``), peft (bare keys or ``base_model.model.``, an ``adapter_config.json``
beside), ComfyUI / kohya files that use the model's own module names (``diffusion_model.`` or the pipeline
prefix, ``lora_unet_<module with _>``; ``lora_down``/``lora_up``; a scalar ``.alpha`` per module), and files in the
model's original (native) layout, placed by the plugin's ``original_weight_targets`` (a fused ``qkv`` update cut
into ``to_q``/``to_k``/``to_v``). Each module's
weight becomes ``W + weight * alpha / rank * B @ A``, computed in float32 and stored in the weight's dtype, only for
the modules of this stage's layers (others are still on the meta device) and before ``quantize`` quantizes them. A
module's update exists only while it is added (one module's weight in float32 at a time).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAIRS = ((".lora_A.weight", ".lora_B.weight"), (".lora_down.weight", ".lora_up.weight"))
PREFIXES = ("base_model.model.", "diffusion_model.", "transformer.", "unet.")


@dataclass(frozen=True)
class ModuleUpdate:
    """One module's LoRA in a merged file: the keys of its down (A) and up (B) matrices, its strength, and the model
    tensors its update goes into, each with the transform cutting that tensor's part out of the update (None: the
    whole update; a native layout's fused ``qkv`` goes into three)."""

    down: str
    up: str
    scale: float
    targets: tuple[tuple[str, Any], ...]


def adapter_file(path: Path) -> Path:
    """The safetensors file of a ``merge_adapters`` entry: the file itself, or a saved folder's
    ``adapter_model.safetensors``."""
    from diffpipe_core.adapters import ADAPTER_FILE

    path = Path(path)
    file = path / ADAPTER_FILE if path.is_dir() else path
    if not file.is_file() or file.suffix != ".safetensors":
        raise ValueError(f"model.merge_adapters: {path}: expected a LoRA .safetensors file or a folder holding "
                         f"{ADAPTER_FILE}")
    return file


def _file_alpha(file: Path, metadata: dict[str, str]) -> float | None:
    """The alpha the file's metadata (diffusers' ``lora_adapter_metadata``) or a peft ``adapter_config.json`` beside
    it gives every module, or None."""
    packed = metadata.get("lora_adapter_metadata")
    config: dict[str, Any] = {}
    if packed:
        for key, value in json.loads(packed).items():
            config[key.rsplit(".", 1)[-1] if "." in key else key] = value
    elif (file.parent / "adapter_config.json").is_file():
        config = json.loads((file.parent / "adapter_config.json").read_text())
    alpha = config.get("lora_alpha", config.get("alpha"))
    return float(alpha) if alpha is not None else None


def module_names(stem: str, modules: set[str], kohya: dict[str, str], prefix: str) -> str | None:
    """The model module a file's key stem names, or None."""
    for head in (f"{prefix}.", *PREFIXES):
        if stem.startswith(head) and stem[len(head):] in modules:
            return stem[len(head):]
    if stem in modules:
        return stem
    if stem.startswith("lora_unet_"):
        return kohya.get(stem[len("lora_unet_"):])
    return None


NativeTargets = Callable[[list[str]], "dict[str, list[tuple[str, Any]]] | None"]


def plan_updates(
    file: Path, modules: Iterable[str], prefix: str, native: NativeTargets | None = None
) -> list[ModuleUpdate]:
    """Every LoRA module of ``file`` placed on the model: on one of its ``modules`` (names), or, for a key stem in
    the model's original layout, on the tensors ``native`` (the plugin's ``original_weight_targets``) gives its
    ``<stem>.weight``; with its scale. A key that is not a LoRA's, or that names nothing of the model, raises a
    ValueError naming it (read from the header only)."""
    from safetensors import safe_open

    names = set(modules)
    kohya = {m.replace(".", "_"): m for m in names}
    with safe_open(str(file), "pt") as f:
        keys = set(f.keys())
        metadata = f.metadata() or {}
        ranks = {k: f.get_slice(k).get_shape()[0] for k in keys if k.endswith((PAIRS[0][0], PAIRS[1][0]))}
        alphas = {k: float(f.get_tensor(k)) for k in keys if k.endswith(".alpha")}
    file_alpha = _file_alpha(file, metadata)
    pairs = [(down, down[: -len(ds)], down[: -len(ds)] + us) for ds, us in PAIRS for down in sorted(keys)
             if down.endswith(ds)]
    placed = {stem: ((m + ".weight", None),) for _, stem, _ in pairs
              if (m := module_names(stem, names, kohya, prefix)) is not None}
    unplaced = [stem + ".weight" for _, stem, _ in pairs if stem not in placed]
    if unplaced and native is not None:
        for key, made in (native(unplaced) or {}).items():
            placed[key[: -len(".weight")]] = tuple(made)
    updates, used = [], set()
    for down, stem, up in pairs:
        if up not in keys:
            raise ValueError(f"model.merge_adapters: {file}: {down} has no {up}")
        if stem not in placed:
            close = difflib.get_close_matches(stem.split(".", 1)[-1], sorted(names), n=3, cutoff=0.5)
            raise ValueError(f"model.merge_adapters: {file}: {down!r} names no module of this model"
                             + (f" (closest: {', '.join(close)})" if close else "")
                             + "; it holds a LoRA of another model or layout")
        rank = ranks[down]
        alpha = alphas.get(stem + ".alpha", file_alpha if file_alpha is not None else float(rank))
        updates.append(ModuleUpdate(down, up, alpha / rank, placed[stem]))
        used |= {down, up, stem + ".alpha"}
    other = sorted(keys - used)
    if other:
        raise ValueError(f"model.merge_adapters: {file}: {other[0]!r} (and {len(other) - 1} more) is not a LoRA "
                         "lora_A/lora_B (or lora_down/lora_up) tensor; only LoRAs merge (a LoKr or LoHa does not)")
    if not updates:
        raise ValueError(f"model.merge_adapters: {file}: holds no LoRA tensors")
    return updates


def merge_into(model: Any, entries: Iterable[Any], prefix: str, native: NativeTargets | None = None) -> int:
    """Add each ``[model] merge_adapters`` entry (``path``, ``weight``) into the weights of ``model`` that hold real
    tensors (this stage's; meta ones are another stage's and skipped); ``native``: see :func:`plan_updates`.
    Returns how many module updates were added (a fused native module counts once). Refuses (ValueError naming it)
    a weight kept quantized from its file."""
    import torch
    from safetensors import safe_open

    modules = [name for name, _ in model.named_modules()]
    tensors = dict(model.named_parameters())
    added = 0
    for entry in entries:
        file = adapter_file(entry.path)
        updates = plan_updates(file, modules, prefix, native)
        with safe_open(str(file), "pt") as f, torch.no_grad():
            for update in updates:
                held = [(tensors[name], fn) for name, fn in update.targets
                        if name in tensors and tensors[name].device.type != "meta"]
                if not held:
                    continue
                down, up = f.get_tensor(update.down).float(), f.get_tensor(update.up).float()
                delta = entry.weight * update.scale * (up.flatten(1) @ down.flatten(1))
                for weight, fn in held:
                    if not weight.is_floating_point() or weight.dtype.itemsize == 1:
                        raise ValueError(f"model.merge_adapters: {update.down} goes into a weight kept quantized "
                                         f"from its file ({weight.dtype}); merge into a bf16/fp16 file, or use "
                                         "[model] quantize on it")
                    part = (fn(delta) if fn else delta).reshape(weight.shape).to(weight.device)
                    weight.copy_((weight.float() + part).to(weight.dtype))
                added += 1
    return added


def native_targets(plugin: Any, model_config: Any) -> NativeTargets | None:
    """The plugin's ``original_weight_targets`` for this model as :func:`plan_updates` takes it, or None."""
    if not plugin.has("original_weight_targets"):
        return None
    return lambda keys: plugin.call("original_weight_targets", model_config=model_config, keys=keys)
