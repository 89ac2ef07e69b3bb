"""A ComfyUI-style adapter loader for tests, written from ComfyUI's documented formulas (``comfy/lora.py``'s
``load_lora`` and ``calculate_weight``, ``comfy/weight_adapter/lora.py``, ``lokr.py``, ``loha.py``).

It applies an adapter file the way ComfyUI patches a model: each key stem of the file is looked up in a key map
(stem -> the patched weight, as ComfyUI's ``model_lora_keys_unet`` builds it) whose value is a weight name or
``(weight name, (dim, start, length), function)``: the patch then goes into that slice of the weight (a diffusers
``to_q`` into Flux's fused ``qkv``) after ``function`` (ComfyUI's ``swap_scale_shift``) is applied to the update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

KeyTarget = str | tuple[str, tuple[int, int, int] | None, Callable[[torch.Tensor], torch.Tensor] | None]
SUFFIXES = (
    "lora_up.weight",
    "lora_down.weight",
    "lora_A.weight",
    "lora_B.weight",
    "lokr_w1",
    "lokr_w1_a",
    "lokr_w1_b",
    "lokr_w2",
    "lokr_w2_a",
    "lokr_w2_b",
    "hada_w1_a",
    "hada_w1_b",
    "hada_w2_a",
    "hada_w2_b",
    "alpha",
)


def generic_key_map(model_keys: Iterable[str], prefix: str = "diffusion_model.") -> dict[str, KeyTarget]:
    """The entries ComfyUI's ``model_lora_keys_unet`` makes for every model from its state dict keys (``model_keys``,
    in ComfyUI's own layout, without ``prefix``): each weight's module under ``prefix`` (``diffusion_model.<module>``)
    and kohya-style (``lora_unet_<module with _>``); a model class may add more (Flux's diffusers names), Wan adds
    none."""
    out: dict[str, KeyTarget] = {}
    for key in model_keys:
        if key.endswith(".weight"):
            module = key[: -len(".weight")]
            out[f"{prefix}{module}"] = f"{prefix}{key}"
            out[f"lora_unet_{module.replace('.', '_')}"] = f"{prefix}{key}"
        else:
            out[f"{prefix}{key}"] = f"{prefix}{key}"
    return out


def delta_weight(tensors: dict[str, torch.Tensor], shape: Iterable[int]) -> torch.Tensor:
    """The weight update of one module's tensors (names as in :data:`SUFFIXES`), reshaped to ``shape``.

    LoKr: ``kron(w1, w2)`` (each factor whole or ``a @ b``) times ``alpha / dim``, ``dim`` being the rank of the
    decomposed factor (``w2_b``'s, else ``w1_b``'s), or times 1 when neither is decomposed or there is no alpha.
    LoHa: ``(w1_a @ w1_b) * (w2_a @ w2_b) * alpha / rows(w1_b)``. LoRA: ``up @ down * alpha / rows(down)``.
    Tucker convs (``lokr_t2``, ``hada_t1``) are not covered.
    """
    t = {k: v.float() for k, v in tensors.items()}
    alpha = float(t["alpha"]) if "alpha" in t else None
    shape = tuple(shape)
    if any(k.startswith("lokr_") for k in t):
        dim = None
        if "lokr_w1" in t:
            w1 = t["lokr_w1"]
        else:
            dim = t["lokr_w1_b"].shape[0]
            w1 = t["lokr_w1_a"] @ t["lokr_w1_b"]
        if "lokr_w2" in t:
            w2 = t["lokr_w2"]
        else:
            dim = t["lokr_w2_b"].shape[0]
            w2 = t["lokr_w2_a"] @ t["lokr_w2_b"]
        if w2.dim() == 4:
            w1 = w1.unsqueeze(2).unsqueeze(2)
        scale = alpha / dim if alpha is not None and dim is not None else 1.0
        return scale * torch.kron(w1, w2).reshape(shape)
    if "hada_w1_a" in t:
        scale = alpha / t["hada_w1_b"].shape[0] if alpha is not None else 1.0
        return scale * ((t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])).reshape(shape)
    up = t.get("lora_up.weight", t.get("lora_B.weight"))
    down = t.get("lora_down.weight", t.get("lora_A.weight"))
    if up is None or down is None:
        raise ValueError(f"no LoRA, LoKr or LoHa tensors among {sorted(tensors)}")
    scale = alpha / down.shape[0] if alpha is not None else 1.0
    return scale * (up.flatten(1) @ down.flatten(1)).reshape(shape)


def group_by_stem(file: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """``{stem: {suffix: tensor}}`` of an adapter file; a key with no known suffix raises (ComfyUI would warn
    "lora key not loaded" and drop it)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in file.items():
        suffix = next((s for s in SUFFIXES if key.endswith("." + s)), None)
        if suffix is None:
            raise ValueError(f"adapter key {key!r} is not one ComfyUI loads")
        out.setdefault(key[: -len(suffix) - 1], {})[suffix] = value
    return out


def apply_file(
    weights: dict[str, torch.Tensor], file: dict[str, torch.Tensor], key_map: dict[str, KeyTarget]
) -> dict[str, torch.Tensor]:
    """``weights`` (the model in ComfyUI's layout) with every module of ``file`` patched in, as ComfyUI does.
    A stem the key map does not know raises, so a test notices keys ComfyUI would not load."""
    out = {k: v.clone().float() for k, v in weights.items()}
    for stem, tensors in group_by_stem(file).items():
        if stem not in key_map:
            raise KeyError(f"ComfyUI would not load {stem!r}: it is not in the model's key map")
        target: Any = key_map[stem]
        name, offset, function = (target, None, None) if isinstance(target, str) else target
        weight = out[name]
        view = weight.narrow(offset[0], offset[1], offset[2]) if offset is not None else weight
        delta = delta_weight(tensors, view.shape)
        view += function(delta) if function is not None else delta
    return out


def merged_weights(model: torch.nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The weights a peft-adapted ``model`` computes with: its state dict under the bare model's names, each
    adapted layer's weight plus peft's own ``get_delta_weight`` (LoRA, LoKr or LoHa), in float32."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    out = {
        k.replace(".base_layer", ""): v.detach().float().clone()
        for k, v in model.state_dict().items()
        if not any(part.startswith(("lora_", "lokr_", "hada_")) for part in k.split("."))
    }
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, BaseTunerLayer) and adapter in getattr(module, "scaling", {}):
                out[f"{name}.weight"] += module.get_delta_weight(adapter).float()
    return out


def transformer_names_key_map(model_keys: Iterable[str], prefix: str = "diffusion_model.") -> dict[str, KeyTarget]:
    """The entries ComfyUI's ``model_lora_keys_unet`` adds for a model whose own weights carry diffusers' names
    (Qwen-Image): ``transformer.<module>`` onto ``<prefix><module>.weight`` (``model_keys`` without ``prefix``)."""
    return {f"transformer.{k[: -len('.weight')]}": f"{prefix}{k}" for k in model_keys if k.endswith(".weight")}


def assert_applies_as_trained(
    applied: dict[str, torch.Tensor],
    trained: dict[str, torch.Tensor],
    untrained: dict[str, torch.Tensor],
    atol: float = 1e-5,
) -> None:
    """A file applied as ComfyUI applies it (``applied``) gives the trained weights key by key, and training moved
    some weight clearly more than the error, so a file applied at another strength (or not at all) fails."""
    missing = sorted(set(trained) - set(applied))
    assert not missing, f"{len(missing)} trained weights not among the applied ones: {missing[:5]}"
    worst = max(float((applied[k] - trained[k]).abs().max()) for k in trained)
    moved = max(float((trained[k] - untrained[k].float()).abs().max()) for k in trained)
    assert worst <= atol, f"applied weights differ from the trained ones by up to {worst:.3g}"
    assert moved > 100 * max(worst, 1e-7), f"training moved the weights by only {moved:.3g}"
