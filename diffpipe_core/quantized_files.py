"""Weight files that are already quantized, as ComfyUI ships them, read as they are stored.

Three layouts are read, each learned from ComfyUI's ``QUANTIZATION.md``, ``comfy/quant_ops.py`` and ``comfy/ops.py``:

- **fp8 scaled** (the older ``*_fp8_scaled.safetensors``): a top-level ``scaled_fp8`` marker tensor, and beside each
  quantized linear's float8 ``weight`` a float32 ``scale_weight`` (optionally ``scale_input``);
- **per-layer quantization metadata** (ComfyUI's current files, the ``comfy_quant`` format): beside each quantized
  weight a ``comfy_quant`` tensor holding the layer's JSON (``{"format": "float8_e4m3fn"}``, ``"int8_tensorwise"``,
  ...), its ``weight_scale`` (one float32 for the tensor, or one per output row) and optionally ``input_scale``; the
  same JSON may instead sit in the file's metadata as ``_quantization_metadata``;
- **plain float8** weights without a scale (``*_fp8_e4m3fn.safetensors``): scale 1.

The weight is ``stored.float() * scale``. A diffusion model trained with LoRA keeps such linears quantized
(:class:`~diffpipe_core.quantize.ScaledLinear`); the VAE and text encoders, used only while caching, are dequantized
to their dtype as they load.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: ComfyUI's format names diffpipe reads -> the storage dtype's name in torch
READABLE = {"float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2", "int8_tensorwise": "int8"}
#: keys that only describe a quantized layer: never a model tensor
MARKERS = ("scaled_fp8",)
SIDE_PARAMS = ("comfy_quant", "scale_input", "input_scale")
SCALE_PARAMS = ("scale_weight", "weight_scale")
FLOAT8 = ("F8_E4M3", "F8_E5M2")


@dataclass(frozen=True)
class QuantizedLayer:
    """One quantized linear of a file: its weight key, storage dtype (torch name, or ``gguf:<type>`` for GGUF blocks)
    and scale key (None: scale 1)."""

    weight: str
    storage: str
    scale: str | None
    format: str
    rotation: int = 0  # convrot: the Hadamard group size the stored weight is rotated by (0: none)

    @property
    def gguf(self) -> bool:
        return self.storage.startswith("gguf:")


class QuantizationError(ValueError):
    """A file quantized in a way diffpipe does not read; the message names the file, the layer and what is read."""


def _module(key: str) -> str:
    return key.rpartition(".")[0]


def quantized_layers(
    path: Path, header: Mapping[str, tuple[str, tuple[int, ...]]], metadata: Mapping[str, str]
) -> dict[str, QuantizedLayer]:
    """The quantized linears of a safetensors file (``header``: key -> (safetensors dtype, shape)), by their module
    path in the file's own key names. Reads only the tiny ``comfy_quant`` tensors. Raises :class:`QuantizationError`
    for a format diffpipe does not read (naming the layer, the format and what is read)."""
    layers: dict[str, QuantizedLayer] = {}
    formats, rotations = _formats(path, header, metadata)
    for key, (dtype, shape) in header.items():
        if not key.endswith(".weight"):
            continue
        module = _module(key)
        fmt = formats.get(module)
        if fmt is None and dtype not in FLOAT8:
            continue
        if fmt is None:
            fmt = "float8_e4m3fn" if dtype == "F8_E4M3" else "float8_e5m2"
        if fmt not in READABLE:
            raise QuantizationError(
                f"{path}: layer {module!r} is quantized as {fmt!r}, which diffpipe does not read; readable: "
                f"{', '.join(READABLE)} (ComfyUI's fp8 scaled and int8 files), or a bf16/fp16 file"
            )
        scale = next((f"{module}.{p}" for p in SCALE_PARAMS if f"{module}.{p}" in header), None)
        if fmt == "int8_tensorwise" and scale is None:
            raise QuantizationError(f"{path}: int8 layer {module!r} has no weight_scale; the file is incomplete")
        rotation = rotations.get(module, 0)
        if rotation and (shape[-1] % rotation or not is_power_of_4(rotation)):
            raise QuantizationError(
                f"{path}: layer {module!r} is rotated in groups of {rotation}, which is no power of 4 dividing its "
                f"{shape[-1]} inputs"
            )
        layers[module] = QuantizedLayer(key, READABLE[fmt], scale, fmt, rotation)
    return layers


def _formats(
    path: Path, header: Mapping[str, tuple[str, tuple[int, ...]]], metadata: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, int]]:
    """Each layer's declared format, from its ``comfy_quant`` tensor, else from ``_quantization_metadata``; and the
    Hadamard group size of the layers stored rotated (ComfyUI's int8 "convrot")."""
    found: dict[str, str] = {}
    rotations: dict[str, int] = {}
    raw = metadata.get("_quantization_metadata")
    confs: dict[str, dict] = {}
    if raw:
        try:
            layers = json.loads(raw).get("layers", {})
        except (ValueError, AttributeError) as exc:
            raise QuantizationError(f"{path}: _quantization_metadata is not readable JSON ({exc})") from exc
        confs.update({name: conf for name, conf in layers.items() if isinstance(conf, dict)})
    keys = [k for k in header if k.endswith(".comfy_quant")]
    if keys:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            confs.update({_module(k): json.loads(f.get_tensor(k).numpy().tobytes()) for k in keys})
    for module, conf in confs.items():
        found[module] = str(conf.get("format", "?"))
        params = conf.get("params", {}) if isinstance(conf.get("params"), dict) else {}
        if conf.get("convrot", params.get("convrot", False)):
            rotations[module] = int(conf.get("convrot_groupsize", params.get("convrot_groupsize", 256)))
    return found, rotations


def is_power_of_4(n: int) -> bool:
    return n >= 4 and n & (n - 1) == 0 and (n.bit_length() - 1) % 2 == 0


def hadamard(size: int) -> Any:
    """The normalised regular Hadamard matrix of ``size`` (a power of 4) ComfyUI's int8 "convrot" files are rotated
    by: Kronecker powers of the symmetric 4x4 seed over ``sqrt(size)``, so it is symmetric and orthogonal (rotating
    twice is the identity), as comfy-kitchen builds it."""
    import torch

    seed = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float32)
    h = seed
    while h.shape[0] < size:
        h = torch.kron(h, seed)
    return h / size**0.5


def rotate(weight: Any, group: int) -> Any:
    """``weight`` (out, in) rotated group-wise along its inputs: each block of ``group`` inputs times the Hadamard
    matrix. It both stores (quantizing) and restores (loading) a convrot weight."""
    out_features, in_features = weight.shape
    h = hadamard(group).to(weight.dtype)
    return (weight.reshape(out_features, in_features // group, group) @ h.T).reshape(out_features, in_features)


GGUF_FLOATS = ("F32", "F16", "BF16")


def gguf_layers(path: Path, header: Mapping[str, tuple[str, tuple[int, ...]]]) -> dict[str, QuantizedLayer]:
    """The quantized linears of a GGUF file (every ``.weight`` in a block format such as ``Q8_0`` or ``Q4_K``), by
    module path in the file's names. Raises :class:`QuantizationError` for another quantized tensor (a 1-D or 4-D
    one diffpipe would have to dequantize whole) or a block format diffusers cannot dequantize."""
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    readable = {t.name for t in SUPPORTED_GGUF_QUANT_TYPES}
    layers = {}
    for key, (kind, shape) in header.items():
        if kind in GGUF_FLOATS:
            continue
        if kind not in readable:
            raise QuantizationError(
                f"{path}: tensor {key!r} is GGUF {kind}, which diffpipe cannot dequantize; readable: "
                f"{', '.join(sorted(readable))}"
            )
        if not key.endswith(".weight") or len(shape) != 2:
            raise QuantizationError(f"{path}: tensor {key!r} ({kind}, shape {shape}) is quantized but is no linear's")
        layers[_module(key)] = QuantizedLayer(key, f"gguf:{kind}", None, kind)
    return layers


def is_side_key(key: str) -> bool:
    """A key that describes quantization rather than holding a model tensor (markers, layer JSON, input scales)."""
    return key in MARKERS or key.rpartition(".")[2] in SIDE_PARAMS


def is_scale_key(key: str) -> bool:
    return key.rpartition(".")[2] in SCALE_PARAMS


def storage_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A stored scale's shape as a :class:`~diffpipe_core.quantize.ScaledLinear` keeps it: ``()`` for one value,
    ``(rows, 1)`` for one per output row."""
    count = 1
    for n in shape:
        count *= n
    return () if count == 1 else (count, 1)


def as_scale(tensor: Any) -> Any:
    """A stored scale in :func:`scale_shape`'s form, float32."""
    import torch

    return tensor.to(torch.float32).reshape(scale_shape(tuple(tensor.shape)))


def dequantize(weight: Any, scale: Any | None, dtype: Any, rotation: int = 0) -> Any:
    """``weight.float() * scale`` in ``dtype`` (scale None: 1), rotated back where the file stores it rotated."""
    import torch

    value = weight.to(torch.float32)
    if scale is not None:
        value = value * as_scale(scale)
    return (rotate(value, rotation) if rotation else value).to(dtype)


def dequantizing(path: Path, layer: QuantizedLayer, dtype: Any) -> Callable[[Any], Any]:
    """A transform of ``layer``'s stored weight into its ``dtype`` value, reading its scale from ``path`` once."""

    def transform(weight: Any) -> Any:
        if layer.gguf:
            from diffpipe_core.weight_files import gguf_dequantize

            rows = weight.shape[0]
            return gguf_dequantize(weight, layer.format).reshape(rows, -1).to(dtype)
        scale = None
        if layer.scale is not None:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                scale = f.get_tensor(layer.scale)
        return dequantize(weight, scale, dtype, layer.rotation)

    return transform
