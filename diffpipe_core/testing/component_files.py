"""Test helpers for model files as users have them: a tiny diffusers folder rewritten as ComfyUI component files
(transformer, VAE and text encoders, each one file in ComfyUI's layout), a folder of only its configs and tokenizers,
and ComfyUI's quantized files (fp8 scaled, the older and the current format, and int8).

    folder = write_tiny_flux(tmp / "model")
    files = write_component_files(folder, tmp / "comfy", transformer_table=layout_for_config(config))
    config_only(folder, tmp / "configs")
    fp8 = quantize_file(files["diffusion_model"], tmp / "fp8.safetensors", "fp8_scaled")
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from diffpipe_core.parts.layout import KeyTable

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json")
COMFY_PREFIX = "model.diffusion_model."


def config_only(folder: Path, out: Path) -> Path:
    """A copy of diffusers folder ``folder`` at ``out`` without any weight file: configs, tokenizers, the scheduler and
    ``model_index.json`` (what a user keeps beside ComfyUI files, or the Hugging Face cache holds without weights)."""
    out = Path(out)
    for file in Path(folder).rglob("*"):
        if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES):
            target = out / file.relative_to(folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, target)
    return out


def hub_snapshot(folder: Path, cache: Path, repo: str) -> Path:
    """``folder``'s configs and tokenizers as the Hugging Face cache keeps a snapshot of ``repo`` (``cache`` is the
    ``HF_HUB_CACHE`` folder); returns the snapshot."""
    root = Path(cache) / f"models--{repo.replace('/', '--')}"
    snapshot = config_only(folder, root / "snapshots" / "0123abcd")
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text("0123abcd")
    return snapshot


def component_state(folder: Path, component: str) -> dict[str, torch.Tensor]:
    """The weights of one component folder as saved (diffusers' or transformers' names)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted((Path(folder) / component).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def save(state: Mapping[str, torch.Tensor], file: Path, metadata: Mapping[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    file.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(file), metadata=dict(metadata or {"format": "pt"}))
    return file


def write_component_files(
    folder: Path,
    out: Path,
    transformer_table: KeyTable | None = None,
    vae_table: KeyTable | None = None,
    text_prefixes: Mapping[str, str] | None = None,
    model: str = "transformer",
) -> dict[str, Any]:
    """Every component of diffusers folder ``folder`` as one ComfyUI-style file under ``out``:
    ``diffusion_model`` (``transformer_table``'s original layout under ``model.diffusion_model.``, or diffusers' names
    under it), ``vae`` (``vae_table``'s layout, or diffusers' names) and each ``text_encoder*`` (transformers' names,
    under ``text_prefixes[name]`` when given). Returns ``{"diffusion_model": path, "vae": path, "text_encoders":
    [paths]}`` in the folder's order."""
    out = Path(out)
    state = component_state(folder, model)
    state = transformer_table.to_original(state) if transformer_table is not None else state
    files: dict[str, Any] = {"diffusion_model": save({COMFY_PREFIX + k: v for k, v in state.items()}, out / "dit.st")}
    if (Path(folder) / "vae").is_dir():
        vae = component_state(folder, "vae")
        files["vae"] = save(vae_table.to_original(vae) if vae_table is not None else vae, out / "vae.st")
    index = json.loads((Path(folder) / "model_index.json").read_text())
    names = sorted(n for n in index if n.startswith("text_encoder") and (Path(folder) / n / "config.json").is_file())
    files["text_encoders"] = []
    for name in names:
        prefix = (text_prefixes or {}).get(name, "")
        state = {prefix + k: v for k, v in component_state(folder, name).items()}
        files["text_encoders"].append(save(state, out / f"{name}.st"))
    return files


def quantize_state(state: Mapping[str, torch.Tensor], form: str, min_elements: int = 256) -> dict[str, torch.Tensor]:
    """``state`` with every 2-D ``.weight`` of at least ``min_elements`` quantized as ComfyUI stores it:

    - ``"fp8_scaled"``: float8_e4m3fn with a float32 ``scale_weight`` each and the ``scaled_fp8`` marker (the older
      files);
    - ``"comfy_quant_fp8"``: float8_e4m3fn with ``weight_scale`` and the layer's ``comfy_quant`` JSON (current files);
    - ``"int8"``: int8 with one ``weight_scale`` per output row and ``comfy_quant`` ``int8_tensorwise``;
    - ``"fp8"``: plain float8_e4m3fn casts, no scale.
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    for key, value in state.items():
        if not (key.endswith(".weight") and value.dim() == 2 and value.numel() >= min_elements):
            out[key] = value
            continue
        module, w = key[: -len(".weight")], value.float()
        if form == "fp8":
            out[key] = w.to(torch.float8_e4m3fn)
        elif form in ("fp8_scaled", "comfy_quant_fp8"):
            scale = w.abs().amax().clamp(min=1e-12) / fp8_max
            out[key] = (w / scale).to(torch.float8_e4m3fn)
            out[f"{module}.{'scale_weight' if form == 'fp8_scaled' else 'weight_scale'}"] = scale.reshape(())
            if form == "comfy_quant_fp8":
                out[f"{module}.comfy_quant"] = _layer_json({"format": "float8_e4m3fn"})
        elif form == "int8":
            scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
            out[key] = (w / scale).round().clamp(-127, 127).to(torch.int8)
            out[f"{module}.weight_scale"] = scale
            out[f"{module}.comfy_quant"] = _layer_json({"format": "int8_tensorwise"})
        else:
            raise ValueError(f"unknown form {form!r}")
    if form == "fp8_scaled":
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


def kept_linears(model: torch.nn.Module, min_elements: int = 256) -> list[str]:
    """The linears of a model loaded from a folder whose weights :func:`quantize_state` quantizes and a quantized
    load keeps quantized: every ``nn.Linear`` of ``min_elements`` weights or more outside the model class's
    ``_keep_in_fp32_modules`` (those load dequantized)."""
    from torch import nn

    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and module.weight.numel() >= min_elements and not keep & set(name.split("."))
    ]


def _layer_json(conf: dict[str, Any]) -> torch.Tensor:
    import torch

    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


def quantize_file(file: Path, out: Path, form: str, min_elements: int = 256) -> Path:
    """Component file ``file`` quantized as :func:`quantize_state` says, saved at ``out``."""
    from safetensors.torch import load_file

    return save(quantize_state(load_file(str(file)), form, min_elements), Path(out))


def dequantized_state(file: Path) -> dict[str, torch.Tensor]:
    """A quantized component file's weights as float32 values (``stored * scale``), markers and scales left out:
    what the quantized file stands for."""
    import torch
    from safetensors.torch import load_file

    state = load_file(str(file))
    out = {}
    for key, value in state.items():
        last = key.rpartition(".")[2]
        if key == "scaled_fp8" or last in ("comfy_quant", "scale_weight", "weight_scale", "input_scale"):
            continue
        module = key.rpartition(".")[0]
        scale = state.get(f"{module}.scale_weight", state.get(f"{module}.weight_scale"))
        value = value.to(torch.float32)
        out[key] = value * scale.float() if scale is not None and last == "weight" else value
    return out
