"""A ``diffusion_model`` file's own variant: the config values that differ from the folder's, read from the file.

A file says what it is in two ways, both read from its header only: its safetensors ``config`` metadata (some single
files carry their diffusers config JSON, whole or under the component's name, as Lightricks' LTX-Video files do), and
its tensors, as ComfyUI's model detection reads them (block counts, widths, flags). The plugin declares the tensor
rules (:attr:`~diffpipe_core.parts.plugin.DiffusersModel.file_config`); the tensors win over the metadata, the
metadata over the folder.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_ABSENT = object()


@dataclass(frozen=True)
class Shape:
    """A config value read from a tensor's shape: size ``dim`` of the first tensor whose key matches ``pattern``
    (searched, any layout, any prefix), divided by ``per`` when given: a config value (the head dim, to read a head
    count from a width; a list divides by its product, as a patch size) or another tensor's size (a :class:`Shape`:
    the width of a per-head norm). ``absent``: the value when no key
    matches (left as the config says when not given), as Wan's ``image_dim`` of a file without an image embedder."""

    pattern: str
    dim: int
    per: str | Shape | None = None
    absent: Any = _ABSENT


#: config key -> a regular expression (with one group, a block index: the block count; without: a flag, set when any
#: key matches) or a :class:`Shape`
FileConfig = Mapping[str, "str | Shape"]


def blocks(*names: str) -> str:
    """The rule of a block count: the blocks ``names.N.`` (any of the names: the original layout's, diffusers')."""
    return rf"(?:^|\.)(?:{'|'.join(map(re.escape, names))})\.(\d+)\."


def present(*modules: str) -> str:
    """The rule of a flag set when the file holds any of ``modules`` (dotted module paths)."""
    return rf"(?:^|\.)(?:{'|'.join(map(re.escape, modules))})\."


def weight_of(*modules: str) -> str:
    """The key pattern of the weight of any of ``modules`` (dotted module paths), for :class:`Shape`."""
    return rf"(?:^|\.)(?:{'|'.join(map(re.escape, modules))})\.weight$"


def from_tensors(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]], rules: FileConfig, config: Mapping[str, Any]
) -> dict[str, Any]:
    """The values ``rules`` read from a file's ``tensors`` (key -> (dtype, shape)); ``config`` gives the divisors of
    :class:`Shape` rules (their own values read first when the rules name them)."""
    found: dict[str, Any] = {}
    ordered = sorted(rules.items(), key=lambda item: isinstance(item[1], Shape) and item[1].per is not None)
    for key, rule in ordered:
        if isinstance(rule, Shape):
            value = _shape_value(tensors, rule, {**config, **found})
            if value is not _ABSENT:
                found[key] = value
            continue
        rx = re.compile(rule)
        if rx.groups:
            indices = [int(m.group(1)) for k in tensors if (m := rx.search(k))]
            if indices:
                found[key] = max(indices) + 1
        else:
            found[key] = any(rx.search(k) for k in tensors)
    return found


def _shape_value(tensors: Mapping[str, tuple[str, tuple[int, ...]]], rule: Shape, config: Mapping[str, Any]) -> Any:
    rx = re.compile(rule.pattern)
    shape = next((shape for k, (_, shape) in sorted(tensors.items()) if rx.search(k)), None)
    if shape is None or len(shape) <= rule.dim:
        return rule.absent
    size = int(shape[rule.dim])
    if rule.per is None:
        return size
    per = _shape_value(tensors, rule.per, config) if isinstance(rule.per, Shape) else config.get(rule.per)
    divisor = math.prod(per) if isinstance(per, list | tuple) else per
    return size // divisor if isinstance(divisor, int) and divisor > 0 else _ABSENT


def from_metadata(metadata: Mapping[str, str], config: Mapping[str, Any], component: str) -> dict[str, Any]:
    """The values of a file's ``config`` metadata (a JSON object: the model's config, or one per component with the
    model's under ``component``) for the keys ``config`` has; {} without one, or when it is not JSON."""
    text = metadata.get("config")
    if not text:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    if isinstance(data, dict) and isinstance(data.get(component), dict):
        data = data[component]
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if k in config and not k.startswith("_")}


def file_variant(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    metadata: Mapping[str, str],
    rules: FileConfig,
    config: Mapping[str, Any],
    component: str,
) -> dict[str, tuple[Any, str]]:
    """The config values a ``diffusion_model`` file reads differently from ``config`` (the folder's): key ->
    ``(value, "metadata" or "tensors")``."""
    meta = from_metadata(metadata, config, component)
    shaped = from_tensors(tensors, rules, {**config, **meta}) if rules else {}
    read = {**meta, **shaped}
    return {k: (v, "tensors" if k in shaped else "metadata") for k, v in read.items() if config.get(k) != v}
