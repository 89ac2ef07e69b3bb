"""Weight files that are already quantized, as ComfyUI ships them, read as they are stored.

Three layouts are read, each learned from ComfyUI's ``QUANTIZATION.md``, ``comfy/quant_ops.py`` and ``comfy/ops.py``:

- **fp8 scaled** (the older ``*_fp8_scaled.safetensors``): a top-level ``scaled_fp8`` marker tensor, and beside each
  quantized linear's float8 ``weight`` a float32 ``scale_weight`` (optionally ``scale_input``);
- **per-layer quantization metadata** (ComfyUI's current files, the ``comfy_quant`` format): beside each quantized
  weight a ``comfy_quant`` tensor holding the layer's JSON (``{"format": "float8_e4m3fn"}``, ``"int8_tensorwise"``,
  ...), its ``weight_scale`` (one float32 for the tensor, or one per output row) and optionally ``input_scale``; the
  same JSON may instead sit in the file's metadata as ``_quantization_metadata``;
- **plain float8** weights without a scale (``*_fp8_e4m3fn.safetensors``): scale 1;
- **NVFP4** (``comfy_quant`` ``{"format": "nvfp4"}``, e.g. ``gemma_3_12B_it_fp4_mixed.safetensors``): beside the
  layer's JSON a ``uint8`` ``weight`` of two FP4 (E2M1) values a byte, ``[rows, cols / 2]``, the first of each pair
  in the high nibble; a ``float8_e4m3fn`` ``weight_scale``, one per 16 inputs of a row, stored in cuBLAS's blocked
  order (``to_blocked``: padded with zeros to tiles of 128 rows by 4 scales, the tiles row-major, inside a tile the
  scale of (row r, block c) at ``(r % 32) * 16 + (r // 32) * 4 + c``), as a ``[roundup(rows, 128), roundup(cols /
  16, 4)]`` tensor; and a float32 ``weight_scale_2`` for the tensor. A value is ``e2m1 * (weight_scale_2 *
  weight_scale)``. Both axes are stored padded with zeros to multiples of 16; a layer whose model shape is smaller
  is cut back to it as it loads. Learned from Comfy-Org/ComfyUI ``comfy/quant_ops.py`` (``QUANT_ALGOS["nvfp4"]``,
  commit 0271a469fe29524fafe5872b737123d65a63e5fc), ``comfy/float.py`` (``to_blocked(flatten=False)``) and
  Comfy-Org/comfy-kitchen ``comfy_kitchen/tensor/nvfp4.py`` (``TensorCoreNVFP4Layout``: ``""``, ``"_scale"``,
  ``"_scale_2"``, padding to 16; commit 0e40907e100f60badc8ad1cd610df414ac22574f) and
  ``comfy_kitchen/backends/eager/quantization.py`` (``quantize_nvfp4`` / ``dequantize_nvfp4``, ``hi_first=True``;
  commit 0935c34bea1b8338742d0f874a4d3dfba3695e15). Other layers of such a "mixed" file stay bf16 or fp8 and read as
  the rest.

The weight is ``stored.float() * scale`` (NVFP4: as above). A diffusion model trained with LoRA keeps such linears
quantized (:class:`~diffpipe_core.quantize.ScaledLinear`), except NVFP4 linears, which are dequantized as they load
(a packed 4-bit weight with block scales is no ScaledLinear's per-tensor or per-row scale; keeping it would need a
module of its own); the VAE and text encoders, used only while caching, are dequantized to their dtype as they load.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: ComfyUI's format names diffpipe reads -> the storage dtype's name in torch
READABLE = {
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2", "int8_tensorwise": "int8", "nvfp4": "uint8",
}  # fmt: skip
#: keys that only describe a quantized layer: never a model tensor
MARKERS = ("scaled_fp8",)
SIDE_PARAMS = ("comfy_quant", "scale_input", "input_scale")
SCALE_PARAMS = ("scale_weight", "weight_scale", "weight_scale_2")
NVFP4_BLOCK = 16
#: the magnitudes of the 8 E2M1 codes (bit 3 is the sign)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
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
    scale_2: str | None = None  # NVFP4: the per-tensor scale's key (``weight_scale`` holds the block scales)

    @property
    def nvfp4(self) -> bool:
        return self.format == "nvfp4"

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
                f"{', '.join(READABLE)} (ComfyUI's fp8 scaled, int8 and NVFP4 files), or a bf16/fp16 file"
            )
        scale = next((f"{module}.{p}" for p in SCALE_PARAMS if f"{module}.{p}" in header), None)
        if fmt == "int8_tensorwise" and scale is None:
            raise QuantizationError(f"{path}: int8 layer {module!r} has no weight_scale; the file is incomplete")
        rotation = rotations.get(module, 0)
        width = shape[-1] * (2 if fmt == "nvfp4" else 1)
        if rotation and (width % rotation or not is_power_of_4(rotation)):
            raise QuantizationError(
                f"{path}: layer {module!r} is rotated in groups of {rotation}, which is no power of 4 dividing its "
                f"{width} inputs"
            )
        scale_2 = _check_nvfp4(path, module, header) if fmt == "nvfp4" else None
        layers[module] = QuantizedLayer(key, READABLE[fmt], scale, fmt, rotation, scale_2)
    return layers


def _roundup(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_nvfp4(path: Path, module: str, header: Mapping[str, tuple[str, tuple[int, ...]]]) -> str:
    """The ``weight_scale_2`` key of NVFP4 layer ``module``, after checking its tensors' dtypes and shapes; raises
    :class:`QuantizationError` naming the tensor, what it is and what it should be."""
    dtype, shape = header[f"{module}.weight"]
    rows, cols = shape if len(shape) == 2 else (0, 0)
    if dtype != "U8" or rows % NVFP4_BLOCK or (2 * cols) % NVFP4_BLOCK or not rows:
        raise QuantizationError(
            f"{path}: nvfp4 layer {module!r}: weight is {dtype} {tuple(shape)}; NVFP4 stores a U8 [rows, inputs / 2] "
            "of packed E2M1 pairs, both axes padded to multiples of 16"
        )
    want = (_roundup(rows, 128), _roundup(2 * cols // NVFP4_BLOCK, 4))
    scale = header.get(f"{module}.weight_scale")
    if scale is None or scale[0] != "F8_E4M3" or _count(scale[1]) != want[0] * want[1]:
        raise QuantizationError(
            f"{path}: nvfp4 layer {module!r}: weight_scale is {scale or 'missing'}; NVFP4 needs F8_E4M3 block scales "
            f"{want} in cuBLAS's blocked order (one per 16 inputs, padded to tiles of 128 x 4)"
        )
    scale_2 = header.get(f"{module}.weight_scale_2")
    if scale_2 is None or _count(scale_2[1]) != 1:
        raise QuantizationError(
            f"{path}: nvfp4 layer {module!r}: weight_scale_2 is {scale_2 or 'missing'}; NVFP4 needs one float32 "
            "per-tensor scale"
        )
    if f"{module}.pre_quant_scale" in header:
        raise QuantizationError(
            f"{path}: nvfp4 layer {module!r} has a pre_quant_scale (activation smoothing), which diffpipe does not read"
        )
    return f"{module}.weight_scale_2"


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def logical_header(
    header: Mapping[str, tuple[str, tuple[int, ...]]], layers: Mapping[str, QuantizedLayer]
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``header`` with each NVFP4 weight's shape as the weight it stands for, ``[rows, 2 * packed columns]`` (its
    16-padded shape), so that it fits a model's shapes as any other weight."""
    out = dict(header)
    for layer in layers.values():
        if layer.nvfp4:
            dtype, (rows, cols) = header[layer.weight]
            out[layer.weight] = (dtype, (rows, 2 * cols))
    return out


def unblock_scales(blocked: Any, rows: int, blocks: int) -> Any:
    """The ``[rows, blocks]`` scales of a tensor stored in cuBLAS's blocked order (``to_blocked``): tiles of 128 rows
    by 4 columns, row-major, each the 32 x 4 x 4 interleave of its rows ``r = 32 i + j`` and columns ``c`` as
    ``(j, i, c)``."""
    tile_rows, tile_cols = _roundup(rows, 128) // 128, _roundup(blocks, 4) // 4
    tiles = blocked.reshape(tile_rows, tile_cols, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(tile_rows * 128, tile_cols * 4)[:rows, :blocks]


def dequantize_nvfp4(packed: Any, block_scales: Any, scale_2: Any, dtype: Any) -> Any:
    """An NVFP4 weight (``packed`` uint8 ``[rows, cols / 2]``, the first value of a pair in the high nibble) as
    ``[rows, cols]`` values in ``dtype``: ``e2m1 * (scale_2 * block scale)``, computed in float32."""
    import torch

    rows, half = packed.shape
    codes = torch.stack((packed >> 4, packed & 15), dim=-1).reshape(rows, 2 * half).long()
    magnitudes = torch.tensor(E2M1, dtype=torch.float32)[codes & 7]
    values = torch.where(codes & 8 != 0, -magnitudes, magnitudes)
    blocks = 2 * half // NVFP4_BLOCK
    scales = unblock_scales(block_scales.view(torch.float8_e4m3fn), rows, blocks).to(torch.float32)
    total = scale_2.to(torch.float32).reshape(()) * scales
    return (values.reshape(rows, blocks, NVFP4_BLOCK) * total.unsqueeze(-1)).reshape(rows, 2 * half).to(dtype)


def unpad(value: Any, shape: tuple[int, ...] | None) -> Any:
    """A 16-padded NVFP4 weight cut back to the model's ``shape`` (as it is when that is not smaller)."""
    if shape is None or len(shape) != 2 or tuple(value.shape) == tuple(shape):
        return value
    if all(s <= v <= _roundup(s, NVFP4_BLOCK) for s, v in zip(shape, value.shape, strict=True)):
        return value[: shape[0], : shape[1]]
    return value


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
        from diffpipe_core.weight_files import open_weights

        with open_weights(path) as f:
            return stored_value(layer, weight, f.get_tensor, dtype)

    return transform


def stored_value(layer: QuantizedLayer, weight: Any, get: Callable[[str], Any], dtype: Any) -> Any:
    """``layer``'s stored ``weight`` as its value in ``dtype``, its scales read through ``get`` (key -> tensor)."""
    if layer.nvfp4:
        assert layer.scale is not None and layer.scale_2 is not None
        value = dequantize_nvfp4(weight, get(layer.scale), get(layer.scale_2), dtype)
        return rotate(value, layer.rotation) if layer.rotation else value
    return dequantize(weight, get(layer.scale) if layer.scale else None, dtype, layer.rotation)
