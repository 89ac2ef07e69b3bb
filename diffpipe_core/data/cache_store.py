"""On-disk shards of cached tensors: one HF ``datasets`` arrow file per shard, fixed-shape columns.

A shard is a folder ``<table>/<name>/`` holding ``data.arrow`` (a ``key`` column plus one
``Array2D``..``Array5D`` column per tensor) and ``meta.json`` (the keys in row order and each column's
per-sample shape and torch dtype). It is written into a hidden temp folder and renamed into place, so
a shard either exists whole or not at all; interrupted caching keeps every shard it finished.

Reads are memory-mapped (``Dataset.from_file``) and a list of rows comes back stacked. bfloat16 is
stored losslessly as its int16 bit pattern (numpy has no bfloat16) and viewed back on read.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from datasets import Array2D, Array3D, Array4D, Array5D, Dataset, Features, Value
from datasets.arrow_writer import ArrowWriter

_ARRAYS = {2: Array2D, 3: Array3D, 4: Array4D, 5: Array5D}
_STORED = {  # torch dtype name -> numpy dtype name used on disk
    "float32": "float32", "float16": "float16", "float64": "float64", "bfloat16": "int16",
    "int64": "int64", "int32": "int32", "int16": "int16", "int8": "int8", "uint8": "uint8", "bool": "bool",
}
TMP_PREFIX = ".tmp-"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _stored_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Per-sample shape as stored: 2..5 dims as is, anything else flattened to ``(1, numel)``."""
    return shape if 2 <= len(shape) <= 5 else (1, math.prod(shape))


@dataclass
class Shard:
    """A finished shard: its folder, its keys in row order and its columns (name -> (shape, dtype))."""

    path: Path
    keys: list[str]
    columns: dict[str, tuple[tuple[int, ...], str]]
    _dataset: Dataset | None = field(default=None, repr=False)
    _arrays: dict[str, np.ndarray] | None = field(default=None, repr=False)

    @property
    def dataset(self) -> Dataset:
        """The shard as a memory-mapped HF dataset (opened on first use: opening a cache stays cheap)."""
        if self._dataset is None:
            self._dataset = Dataset.from_file(str(self.path / "data.arrow"), in_memory=False).with_format("numpy")
        return self._dataset

    def arrays(self) -> dict[str, np.ndarray]:
        """Each column as one ``(rows, *shape)`` numpy array over the memory-mapped file (no copy for
        numeric columns in one chunk); row gathers are then plain numpy indexing."""
        if self._arrays is None:
            table = self.dataset.data
            arrays = {}
            for name, (shape, dtype) in self.columns.items():
                parts = []
                for chunk in table.column(name).chunks:
                    values = chunk.storage if isinstance(chunk, pa.ExtensionArray) else chunk
                    while pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type):
                        values = values.flatten()
                    flat = values.to_numpy(zero_copy_only=False)
                    parts.append(np.asarray(flat, dtype=_STORED[dtype]).reshape(len(chunk), *shape))
                arrays[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
            self._arrays = arrays
        return self._arrays

    def gather(self, rows: list[int]) -> dict[str, torch.Tensor]:
        """The given rows, stacked per column, as torch tensors in their original dtype and shape."""
        out: dict[str, torch.Tensor] = {}
        for name, array in self.arrays().items():
            tensor = torch.from_numpy(np.ascontiguousarray(array[rows]))
            if self.columns[name][1] == "bfloat16":
                tensor = tensor.view(torch.bfloat16)
            out[name] = tensor
        return out


def write_shard(table_dir: Path, prefix: str, keys: list[str], tensors: dict[str, torch.Tensor]) -> Shard:
    """Write one shard atomically (temp folder, then rename) and return it.

    ``tensors`` are batch-first with ``len(keys)`` rows; names must not be ``key``.
    """
    if not keys:
        raise ValueError("write_shard: no rows")
    columns: dict[str, tuple[tuple[int, ...], str]] = {}
    features: dict[str, object] = {"key": Value("string")}
    batch: dict[str, object] = {"key": list(keys)}
    for name, tensor in tensors.items():
        if name == "key":
            raise ValueError("a cached tensor may not be called 'key'")
        if tensor.shape[0] != len(keys):
            raise ValueError(f"cached tensor {name!r} has {tensor.shape[0]} rows for {len(keys)} keys")
        dtype = _dtype_name(tensor.dtype)
        if dtype not in _STORED:
            raise ValueError(f"cached tensor {name!r} has dtype {dtype}, which the cache cannot store "
                             f"(storable: {', '.join(_STORED)})")
        shape = tuple(tensor.shape[1:])
        stored = _stored_shape(shape)
        t = tensor.detach().to("cpu").contiguous()
        if dtype == "bfloat16":
            t = t.view(torch.int16)
        batch[name] = t.numpy().reshape(len(keys), *stored)
        features[name] = _ARRAYS[len(stored)](shape=stored, dtype=_STORED[dtype])
        columns[name] = (shape, dtype)

    table_dir.mkdir(parents=True, exist_ok=True)
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    tmp = table_dir / f"{TMP_PREFIX}{name}"
    tmp.mkdir()
    try:
        writer = ArrowWriter(features=Features(features), path=str(tmp / "data.arrow"))
        writer.write_batch(batch)
        writer.finalize()
        writer.close()
        meta = {"keys": list(keys), "columns": {k: [list(s), d] for k, (s, d) in columns.items()}}
        (tmp / "meta.json").write_text(json.dumps(meta))
        final = table_dir / name
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Shard(final, list(keys), columns)


def list_shards(table_dir: Path) -> list[Shard]:
    """Every finished shard in ``table_dir`` (sorted by name; temp folders are ignored)."""
    if not table_dir.is_dir():
        return []
    shards = []
    names = sorted(e.name for e in os.scandir(table_dir) if e.is_dir() and not e.name.startswith(TMP_PREFIX))
    for name in names:
        path = table_dir / name
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError):
            continue  # not a finished shard (written by hand or damaged): never read it
        columns = {k: (tuple(s), d) for k, (s, d) in meta["columns"].items()}
        shards.append(Shard(path, meta["keys"], columns))
    return shards


def remove_temp_dirs(table_dir: Path) -> int:
    """Delete temp folders left by interrupted writers; call only while no writer runs."""
    if not table_dir.is_dir():
        return 0
    removed = 0
    for path in table_dir.iterdir():
        if path.name.startswith(TMP_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed
