"""Reading tensors from a weight file, safetensors or GGUF, one tensor at a time (per-stage loading reads only its
stage's).

GGUF files (city96's for Flux, Wan, HunyuanVideo, ... as ComfyUI-GGUF loads them) hold the original layout's names;
a quantized tensor (``Q8_0``, ``Q4_K``, ...) is read as its raw bytes, ``(rows, bytes per row)`` uint8, which
:class:`~diffpipe_core.quantize.GGUFLinear` keeps and dequantizes in its forward; float tensors (F32, F16, BF16) are
read as torch tensors of their shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
GGUF_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a GGUF file (by its magic bytes, whatever its name)."""
    try:
        with Path(path).open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


class GGUFWeights:
    """A GGUF file's tensors by name, as :func:`open_weights` returns them (``keys``, ``get_tensor``)."""

    def __init__(self, path: Path, device: str = "cpu") -> None:
        from gguf import GGUFReader

        self.device = device
        self._tensors = {t.name: t for t in GGUFReader(str(path)).tensors}

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_tensor(self, key: str) -> Any:
        import torch

        tensor = self._tensors[key]
        kind = tensor.tensor_type.name
        data = torch.from_numpy(tensor.data.copy())
        if kind == "BF16":  # stored as raw bytes
            data = data.view(torch.bfloat16).reshape(tuple(reversed([int(n) for n in tensor.shape])))
        return data.to(self.device)


@contextmanager
def open_weights(path: Path, device: str = "cpu") -> Iterator[Any]:
    """A weight file's tensors (``keys()``, ``get_tensor(key)``): ``safetensors.safe_open`` for safetensors, a
    :class:`GGUFWeights` for GGUF."""
    if is_gguf(path):
        yield GGUFWeights(path, device)
        return
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=device) as f:
        yield f


def gguf_header(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    """A GGUF file's tensors (name -> (type name such as ``"Q8_0"`` or ``"F16"``, the tensor's shape as the model
    holds it)) and its string metadata, without reading tensor data. Raises ValueError naming the file when it is not
    a readable GGUF file."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
    except Exception as exc:  # gguf raises bare ValueErrors and struct errors on a damaged file
        raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    tensors = {t.name: (t.tensor_type.name, tuple(reversed([int(n) for n in t.shape]))) for t in reader.tensors}
    metadata = {}
    for name, field in reader.fields.items():
        if name.startswith("general.") and field.types and field.types[0].name == "STRING":
            metadata[name] = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    return tensors, metadata


def gguf_dequantize(raw: Any, kind: str) -> Any:
    """A GGUF tensor's raw bytes (``(rows, bytes per row)`` uint8) of quantization ``kind`` as float32 values
    (diffusers' GGUF dequantization, which runs on the tensor's device)."""
    import gguf
    import torch
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    qtype = gguf.GGMLQuantizationType[kind]
    return dequantize_gguf_tensor(GGUFParameter(raw, quant_type=qtype)).to(torch.float32)
