"""Checking a model's files before any work: the ``validate_model_files`` hook and helpers plugins share.

The helpers read only what says what the files are (``model_index.json`` and ``config.json`` class names,
which components and weight files exist, safetensors headers), never the weights, so a wrong folder (an SDXL
folder given to Flux) is reported by ``diffpipe validate`` in well under a second.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

TOKENIZER = "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "spiece.model")
IMAGE_PROCESSOR = "image_processor"  # an image processor's folder (CLIP's, SigLIP's): preprocessor_config.json
IMAGE_PROCESSOR_FILES = ("preprocessor_config.json",)


def model_file_problems(plugin: Any, model_config: Any) -> list[str]:
    """What the model plugin's ``validate_model_files`` finds wrong with the configured files (``[]`` when the
    plugin does not implement the hook). A crash of the check itself is reported as a problem, not raised."""
    try:
        found = plugin.call("validate_model_files", model_config=model_config)
    except Exception as exc:  # a plugin bug must not hide behind a traceback
        return [f"model plugin {plugin.name!r}: validate_model_files failed: {type(exc).__name__}: {exc}"]
    return list(found or [])


def read_json(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(data, None)``, or ``(None, problem)`` naming the file when it is missing or not a JSON object."""
    if not path.is_file():
        return None, f"{path}: not found"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"{path}: not readable JSON ({exc})"
    if not isinstance(data, dict):
        return None, f"{path}: expected a JSON object, found {type(data).__name__}"
    return data, None


def config_class(folder: Path) -> str | None:
    """The class a component folder's ``config.json`` names: diffusers' ``_class_name`` or the first of
    transformers' ``architectures``; None when there is none."""
    data, _ = read_json(folder / "config.json")
    if data is None:
        return None
    if isinstance(data.get("_class_name"), str):
        return data["_class_name"]
    arch = data.get("architectures")
    return arch[0] if isinstance(arch, list) and arch and isinstance(arch[0], str) else None


def _names(expected: Iterable[str]) -> str:
    return " or ".join(repr(e) for e in expected)


def check_component(folder: Path, expected: tuple[str, ...], what: str) -> list[str]:
    """One component folder (``vae/``, ``text_encoder/``): present, with a config naming an expected class.
    ``expected == ("tokenizer",)`` checks for tokenizer files instead, ``("image_processor",)`` for an image
    processor's ``preprocessor_config.json``."""
    if not folder.is_dir():
        return [f"{folder}: missing; expected the {what} ({_names(expected)})"]
    for kind, files in ((TOKENIZER, TOKENIZER_FILES), (IMAGE_PROCESSOR, IMAGE_PROCESSOR_FILES)):
        if expected == (kind,):
            if not any((folder / f).is_file() for f in files):
                what_files = kind.replace("_", " ")
                return [f"{folder}: no {what_files} files (expected one of {', '.join(files)})"]
            return []
    if not (folder / "config.json").is_file():
        return [f"{folder / 'config.json'}: not found; expected the {what}'s config ({_names(expected)})"]
    found = config_class(folder)
    if found not in expected:
        return [f"{folder / 'config.json'}: the {what} is {found!r}; expected {_names(expected)}"]
    return pickle_only_problems(folder, what)


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def pickle_only_problems(folder: Path, what: str) -> list[str]:
    """A component folder whose weights exist only as pickle files (``pytorch_model.bin``): refused, since
    loading a pickle runs whatever code the file holds (diffpipe reads and writes safetensors only)."""
    if any(folder.glob("*.safetensors")):
        return []
    pickles = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix in PICKLE_SUFFIXES)
    if not pickles:
        return []
    return [
        f"{folder}: the {what}'s weights are only pickle files ({', '.join(pickles[:3])}); loading a pickle runs "
        "code from the file, so diffpipe loads safetensors only: convert them (load the folder once where you "
        "trust it, then save_pretrained(..., safe_serialization=True)) or download the safetensors version"
    ]


def pipeline_index(folder: Path) -> Path:
    """The file naming a diffusers folder's pipeline and components: ``model_index.json``, or for a modular
    pipeline's folder (``ModularPipeline.save_pretrained``: Anima's) ``modular_model_index.json`` when it has no
    ``model_index.json``."""
    modular = Path(folder) / "modular_model_index.json"
    plain = Path(folder) / "model_index.json"
    return modular if modular.is_file() and not plain.is_file() else plain


def check_diffusers_folder(
    folder: Path,
    pipelines: tuple[str, ...],
    components: Mapping[str, tuple[str, ...]],
    model_name: str,
) -> list[str]:
    """A diffusers pipeline folder: ``model_index.json`` (:func:`pipeline_index`) names one of ``pipelines`` and every
    component folder exists with an expected class (``components``: folder name -> accepted class names, or
    ``("tokenizer",)`` / ``("image_processor",)``). A wrong ``model_index.json`` is reported alone: the rest would
    only repeat it."""
    if not folder.is_dir():
        what = "a file" if folder.exists() else "not found"
        return [f"{folder}: {what}; expected a diffusers {model_name} folder with model_index.json"]
    index_file = pipeline_index(folder)
    index, problem = read_json(index_file)
    if index is None:
        return [f"{problem}; expected a diffusers {model_name} folder ({_names(pipelines)})"]
    found = index.get("_class_name")
    if found not in pipelines:
        parts = ", ".join(k for k, v in index.items() if not k.startswith("_") and isinstance(v, list))
        return [
            f"{index_file}: the pipeline is {found!r} (components: {parts or 'none'}); "
            f"model {model_name!r} expects {pipelines[0]!r}"
            + (f" or a variant ({', '.join(pipelines[1:])})" if len(pipelines) > 1 else "")
        ]
    problems = []
    for name, expected in components.items():
        what = name.replace("_", " ")
        problems += check_component(folder / name, expected, what)
    return problems


Header = dict[str, tuple[str, tuple[int, ...]]]


def safetensors_header(path: Path) -> tuple[Header | None, dict[str, str], str | None]:
    """A safetensors file's tensors (key -> (safetensors dtype such as ``"BF16"``, shape)) and metadata, read from its
    header alone (no tensor is read), or ``(None, {}, problem)`` naming the file: not found, not safetensors, or
    truncated (shorter than its tensors' offsets say, as an interrupted download leaves it)."""
    if not path.is_file():
        return None, {}, f"{path}: not found"
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a safetensors header")
            (size,) = struct.unpack("<Q", head)
            if size > 100 * 2**20:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError) as exc:
        return None, {}, f"{path}: not a safetensors file ({exc})"
    metadata = header.pop("__metadata__", None) or {}
    tensors: Header = {}
    end = 0
    for key, info in header.items():
        try:
            tensors[key] = (str(info["dtype"]), tuple(int(n) for n in info["shape"]))
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            return None, {}, f"{path}: not a safetensors file (tensor {key!r} has no dtype, shape or offsets)"
    have = path.stat().st_size - 8 - size
    if have < end:
        return None, {}, (
            f"{path}: truncated: its header describes {end + 8 + size} bytes but the file has {path.stat().st_size} "
            "(an interrupted download or copy?); download or copy it again"
        )
    return tensors, {str(k): str(v) for k, v in metadata.items()}, None


def safetensors_keys(path: Path) -> tuple[list[str] | None, str | None]:
    """The tensor names in a safetensors file's header (no tensor is read), or ``(None, problem)``."""
    header, _, problem = safetensors_header(path)
    return (None, problem) if header is None else (list(header), None)


DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
#: the weight file stems of a diffusers component folder, in the order they are looked for (some hub downloads hold
#: only the ``fp16`` variant)
WEIGHT_STEMS = ("diffusion_pytorch_model", "diffusion_pytorch_model.fp16")


def diffusers_weight_files(folder: Path, hint: str = "", what: str = "") -> list[Path]:
    """The safetensors files of a diffusers component folder (``transformer/``): the shards that
    ``diffusion_pytorch_model.safetensors.index.json`` names, sorted, or the single
    ``diffusion_pytorch_model.safetensors`` (else the ``.fp16`` variant of either). Raises FileNotFoundError naming the
    folder (and ``what`` is missing, e.g. "UNet weights") when none is there (``hint`` is appended: what else the user
    could give), ValueError naming the index when it has no weight_map."""
    for stem in WEIGHT_STEMS:
        index = folder / f"{stem}.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index}: no weight_map (tensor name -> shard file); not a safetensors shard index")
            return sorted({folder / name for name in weight_map.values()})
        if (folder / f"{stem}.safetensors").is_file():
            return [folder / f"{stem}.safetensors"]
    files = f"{DIFFUSERS_WEIGHTS}, its .index.json or their .fp16 variant"
    found = f"{what} ({files})" if what else f"{DIFFUSERS_WEIGHTS} (nor its .index.json or their .fp16 variant)"
    raise FileNotFoundError(f"{folder}: no {found}" + (f"; {hint}" if hint else ""))
