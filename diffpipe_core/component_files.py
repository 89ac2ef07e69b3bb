"""Model components given as single files (``[model] diffusion_model``, ``vae``, ``text_encoders``, ``audio_vae``), as
users keep them for ComfyUI, and the folder their configs come from.

A component file may name its tensors as diffusers / transformers do, under a prefix of its own (ComfyUI's
``model.diffusion_model.``, ``first_stage_model.``, ``text_encoders.t5xxl.transformer.``, ...) or without one the
model has (``text_model.``), or in an original release's layout, which a plugin's key table (or the core's, for the LDM
VAE) reads. Which prefixes a file uses is read from its keys and the component's shapes, so no list of prefixes has to
be kept up to date. Quantized files are read as :mod:`diffpipe_core.quantized_files` describes.

The configs, tokenizers and scheduler come from ``[model] path`` (a diffusers folder, whose components given as
files need only their config files), or, without it, from the snapshot of the model's published repository in the
Hugging Face cache. Weights are never downloaded.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffpipe_core.model_files import Header, safetensors_header
from diffpipe_core.quantized_files import (
    QuantizedLayer,
    is_scale_key,
    is_side_key,
    logical_header,
    quantized_layers,
)
from diffpipe_core.weight_files import gguf_header, is_gguf

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diffpipe_core.parts.layout import KeyTable

KeyMap = Callable[[str], str | None]


# ---------------------------------------------------------------------------------------------- the config folder
def hub_cache() -> Path:
    """The Hugging Face hub cache folder (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser()
    return home / "hub"


def cached_snapshot(repos: Sequence[str], model_type: str) -> Path:
    """The cached snapshot of the first of ``repos`` found in the Hugging Face cache (the revision ``refs/main``
    names, else the newest), to read configs, tokenizers and the scheduler from. Raises ValueError saying exactly
    what to give when there is none."""
    cache = hub_cache()
    for repo in repos:
        folder = cache / f"models--{repo.replace('/', '--')}"
        snapshots = folder / "snapshots"
        main = folder / "refs" / "main"
        if main.is_file() and (snapshots / main.read_text().strip()).is_dir():
            return snapshots / main.read_text().strip()
        found = sorted(snapshots.glob("*"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
        if found:
            return found[-1]
    if not repos:
        raise ValueError(
            f"required for model {model_type!r}: a diffusers folder of the model (with component files given, it "
            "needs only the config and tokenizer files)"
        )
    fetch = f"hf download {repos[0]} --exclude '*.safetensors' '*.bin' '*.pth' '*.gguf'"
    raise ValueError(
        f"required: not given, and no snapshot of {' or '.join(repos)} is in the Hugging Face cache ({cache}); give "
        "path = a diffusers folder of the model (beside component files it needs only the config and tokenizer "
        f"files), or put those small files in the cache once with: {fetch}"
    )


# ---------------------------------------------------------------------------------------------- reading a file
@dataclass
class ComponentFile:
    """A component file's header: its tensors, metadata, quantized layers and how its keys fit a model."""

    path: Path
    tensors: Header
    metadata: dict[str, str]
    quantized: dict[str, QuantizedLayer] = field(default_factory=dict)

    @property
    def weights(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The tensors that are model tensors (not quantization markers, layer JSON or scales)."""
        return {k: v for k, v in self.tensors.items() if not is_side_key(k) and not is_scale_key(k)}

    def quantization(self) -> str:
        """How the file stores its weights: ``"bfloat16"``, ``"fp8 scaled (float8_e4m3fn, 120 layers)"``, ..."""
        stored = {q.weight for q in self.quantized.values()}
        dtypes = Counter(DTYPE_NAMES.get(d, d) for k, (d, _) in self.weights.items() if k not in stored)
        plain = "/".join(d for d, _ in dtypes.most_common(2))
        if not self.quantized:
            return plain
        formats = Counter(q.format for q in self.quantized.values())
        scaled = "scaled " if any(q.scale for q in self.quantized.values()) else ""
        kinds = ", ".join(f"{f} x{n}" for f, n in formats.most_common())
        return f"quantized {scaled}({kinds}; the rest {plain})"

    def parameter_count(self) -> int:
        total = 0
        for _, shape in self.weights.values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


DTYPE_NAMES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I8": "int8", "U8": "uint8", "I64": "int64", "I32": "int32", "BOOL": "bool", "F64": "float64",
}  # fmt: skip


def read_component_file(path: Path, what: str) -> ComponentFile:
    """The header of component file ``path`` (``what`` names the ``[model]`` key for messages). Raises ValueError,
    naming the file and what would be valid, for a file that is not safetensors, is truncated, or is quantized in a
    way diffpipe does not read."""
    path = Path(path)
    if is_gguf(path):
        from diffpipe_core.quantized_files import gguf_layers

        try:
            tensors, metadata = gguf_header(path)
            return ComponentFile(path, tensors, metadata, gguf_layers(path, tensors))
        except ValueError as exc:
            raise ValueError(f"model.{what}: {exc}") from exc
    tensors, metadata, problem = safetensors_header(path)
    if tensors is None:
        raise ValueError(f"model.{what}: {problem}")
    layers = quantized_layers(path, tensors, metadata)
    return ComponentFile(path, logical_header(tensors, layers), metadata, layers)


# ---------------------------------------------------------------------------------------------- fitting keys
def prefix_key_map(
    file_keys: Iterable[str], model_shapes: Mapping[str, tuple[int, ...]], file_shapes: Mapping[str, Any]
) -> tuple[KeyMap, str, str] | None:
    """The renaming that puts a file's keys on the model's when they differ only by leading prefixes (the file's
    ``model.diffusion_model.`` or ``text_encoders.clip_l.transformer.`` dropped, the model's ``text_model.`` added; a
    file may need several pairs, as a Qwen2.5-VL file whose ``model.`` is transformers' ``model.language_model.`` and
    whose ``visual.`` is ``model.visual.``): ``(key map, file prefix, model prefix)`` of the most used pair, or None
    when the pairs do not map most of the file onto the model with equal shapes. The pairs are voted for by the keys
    themselves, each key taking the most voted pair that names a model tensor."""
    keys = [k for k in file_keys if not is_side_key(k) and not is_scale_key(k)]
    heads = {".".join(m.split(".")[:n]) for m in model_shapes for n in range(0, 3)}
    model_prefixes = sorted({f"{h}." if h else "" for h in heads}, key=len)
    votes: Counter[tuple[str, str]] = Counter()
    for key in keys:
        parts = key.split(".")
        for i in range(len(parts)):
            strip, rest = ".".join(parts[:i]) + ("." if i else ""), ".".join(parts[i:])
            for add in model_prefixes:
                name = add + rest
                if name in model_shapes and tuple(model_shapes[name]) == tuple(file_shapes[key]):
                    votes[(strip, add)] += 1
    pairs = [pair for pair, n in votes.most_common() if n * 50 >= len(keys)]  # 2% of the keys at least
    if not pairs:
        return None
    if ("", "") not in pairs:  # a key under the model's own name (Qwen2.5-VL's one lm_head beside model.*, visual.*)
        pairs.append(("", ""))

    def mapped(key: str) -> str | None:
        if is_side_key(key) or is_scale_key(key):
            return None
        for strip, add in pairs:
            if key.startswith(strip) and (name := add + key[len(strip) :]) in model_shapes:
                return name
        return None

    fitting = [k for k in keys if (m := mapped(k)) is not None and tuple(model_shapes[m]) == tuple(file_shapes[k])]
    return (mapped, *pairs[0]) if len(fitting) >= max(1, len(keys) // 2) else None


@dataclass(frozen=True)
class Fit:
    """How a component file's keys fit a model: a key map (file key -> model key or fused parts, as per-stage
    loading's key maps), the layout's name for messages, and how many of the model's tensors it fills."""

    key_map: Callable[[str], Any]
    layout: str
    covered: int
    total: int
    table: KeyTable | None = None
    optional: tuple[str, ...] = ()  # prefixes of model tensors the file may lack (loaded as zeros)
    missing: tuple[str, ...] = ()  # the first few model tensors the file does not fill

    @property
    def complete(self) -> bool:
        return self.covered == self.total


def fit_file(
    file: ComponentFile,
    model_shapes: Mapping[str, tuple[int, ...]],
    tables: Sequence[KeyTable] = (),
    tied: Mapping[str, str] | None = None,
    optional: tuple[str, ...] = (),
) -> Fit | None:
    """The best way ``file``'s keys fit a model of ``model_shapes``: by prefixes (diffusers' / transformers' own
    names), else through one of ``tables`` (original layouts). ``tied``: model tensor name -> the name of the tensor
    it is (tied weights, such as T5's ``encoder.embed_tokens`` and ``shared``: a file holds one of them).
    ``optional``: prefixes of model tensors the file need not hold (a language model's head or vision tower that
    text encoding never runs: ComfyUI's files leave them out); they count neither way. None when neither places at
    least half the model."""
    shapes = {k: v[1] for k, v in file.weights.items()}
    same = dict(tied or {})
    required = {n: s for n, s in model_shapes.items() if not n.startswith(optional)} if optional else model_shapes
    total = len({same.get(n, n) for n in required})
    best: Fit | None = None
    found = prefix_key_map(shapes, model_shapes, shapes)
    if found is not None:
        key_map, strip, add = found
        layout = "diffusers" + (f" (under {strip.rstrip('.')!r})" if strip else "")
        covered, missing = _covered(shapes, key_map, required, same)
        best = Fit(key_map, layout, covered, total, None, optional, missing)
    for table in tables:
        key_map = table.key_map(shapes)
        covered, missing = _covered(shapes, key_map, required, same)
        if best is None or covered > best.covered:
            best = Fit(key_map, f"{table.name} layout", covered, total, table, optional, missing)
    if best is None or best.covered * 2 < best.total:
        return None
    return best


def _covered(
    shapes: Mapping[str, tuple[int, ...]], key_map: Callable[[str], Any], model: Mapping[str, Any], same: Mapping
) -> tuple[int, tuple[str, ...]]:
    """How many of the model's tensors the file fills, and the first few it does not."""
    from diffpipe_core.engine.model_loading import key_targets

    filled = {same.get(n, n) for key in shapes for n, _ in key_targets(key_map(key)) if n in model}
    missing = tuple(n for n in model if same.get(n, n) not in filled)
    return len(filled), missing[:4]


def tied_names(model: nn.Module) -> dict[str, str]:
    """Each name of a tensor the model holds under several names (tied weights) -> its first name."""
    first: dict[int, str] = {}
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        out[name] = first.setdefault(id(tensor), name)
    return {k: v for k, v in out.items() if k != v or list(out.values()).count(v) > 1}


def human_count(n: int) -> str:
    """``1234567`` -> ``"1.23 M"`` (k, M, B)."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


# ---------------------------------------------------------------------------------------------- loading
def load_into(model: nn.Module, file: ComponentFile, fit: Fit, what: str) -> nn.Module:
    """Fill ``model`` (a skeleton on meta, cast to its dtypes) from ``file`` through ``fit``, dequantizing quantized
    weights to each tensor's dtype; ties tied weights; raises ValueError naming the file and the missing or misshapen
    tensors."""
    import torch

    from diffpipe_core.engine.model_loading import key_targets, meta_tensors
    from diffpipe_core.quantized_files import stored_value, unpad
    from diffpipe_core.weight_files import gguf_dequantize, open_weights

    target = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    with open_weights(file.path) as f:
        for key in file.weights:
            made = [(n, fn) for n, fn in key_targets(fit.key_map(key)) if n in target]
            if not made:
                continue
            value = f.get_tensor(key)
            layer = file.quantized.get(key.rpartition(".")[0])
            if layer is not None and layer.weight == key and layer.gguf:
                value = gguf_dequantize(value, layer.format).reshape(file.tensors[key][1])
            elif layer is not None and layer.weight == key:
                value = stored_value(layer, value, f.get_tensor, torch.float32)
            for name, transform in made:
                part = transform(value) if transform else value
                if layer is not None and layer.nvfp4 and layer.weight == key:  # stored padded to 16s
                    part = unpad(part, tuple(target[name].shape))
                if tuple(part.shape) != tuple(target[name].shape):
                    raise ValueError(
                        f"model.{what}: {file.path}: tensor {key!r} has shape {tuple(part.shape)}, but the model's "
                        f"{name!r} needs {tuple(target[name].shape)}: the file is of another size of the model than "
                        "its config (check path's config for this component)"
                    )
                state[name] = part.to(target[name].dtype if target[name].is_floating_point() else part.dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    if fit.optional:  # tensors the file may lack and nothing runs: zeros, so the model moves and saves whole
        absent = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in target.items() if n.startswith(fit.optional)}
        model.load_state_dict({n: v for n, v in absent.items() if n not in state}, strict=False, assign=True)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
    refresh_weight_norms(model)
    missing = meta_tensors(model)
    if missing:
        raise ValueError(
            f"model.{what}: {file.path}: {len(missing)} of the model's tensors are not in the file, e.g. "
            f"{missing[:3]} (it is read as {fit.layout}); is it the right component?"
        )
    return model


def refresh_weight_norms(model: nn.Module) -> None:
    """Recompute the ``weight`` of every ``torch.nn.utils.weight_norm`` module from its loaded ``weight_g`` /
    ``weight_v`` (the attribute its hook computed when the skeleton was built on meta; its forward recomputes it)."""
    from torch.nn.utils.weight_norm import WeightNorm

    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, WeightNorm) and not getattr(module, f"{hook.name}_v").is_meta:
                setattr(module, hook.name, hook.compute_weight(module))


def model_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The shapes of a (meta) model's parameters and persistent buffers, by name."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def assign_text_encoders(
    files: Sequence[tuple[str, Path]],
    candidates: Mapping[str, Mapping[str, tuple[int, ...]]],
    describe: Mapping[str, str],
    tied: Mapping[str, Mapping[str, str]],
    optional: Mapping[str, tuple[str, ...]] | None = None,
    tables: Mapping[str, Sequence[KeyTable]] | None = None,
) -> dict[str, tuple[ComponentFile, Fit]]:
    """Which text encoder component each file of ``[model] text_encoders`` holds (``files``: ``(what, path)``), read
    from its tensors against each candidate's shapes (``candidates``: component -> shapes; ``describe``: component ->
    what it is, for messages; ``tied``: component -> :func:`tied_names`; ``optional``: component -> prefixes of
    tensors a file may lack, as :func:`fit_file`'s; ``tables``: component -> the original layouts its file may be
    in). Raises ValueError naming the file and the model's text encoders when a file fits none, or when two files
    hold the same one."""
    chosen: dict[str, tuple[ComponentFile, Fit]] = {}
    for what, path in files:
        file = read_component_file(path, what)
        fits = {
            n: fit_file(file, shapes, (tables or {}).get(n, ()), tied.get(n), (optional or {}).get(n, ()))
            for n, shapes in candidates.items()
        }
        complete = {name: fit for name, fit in fits.items() if fit is not None and fit.complete}
        if not complete:
            sample = ", ".join(list(file.weights)[:3])
            have = "; ".join(f"{name}: {describe[name]}" for name in candidates)
            raise ValueError(
                f"model.{what}: {path}: holds none of this model's text encoders ({have}); its keys begin "
                f"{sample}"
            )
        name = max(complete, key=lambda n: complete[n].covered)
        if name in chosen:
            raise ValueError(f"model.{what}: {path}: holds {name}, which {chosen[name][0].path} already gives")
        chosen[name] = (file, complete[name])
    return chosen


# ---------------------------------------------------------------------------------------------- a quantized model
@dataclass(frozen=True)
class KeptQuantized:
    """A model linear that keeps a file's quantized weight: its storage dtype and scale shape."""

    storage: str
    scale_shape: tuple[int, ...]
    per_row: bool
    scaled: bool = True  # False: the file stores no scale (plain float8 casts), the scale is 1
    rotation: int = 0  # convrot: the Hadamard group size the stored weight is rotated by


def quantized_plan(model: nn.Module, file: ComponentFile, fit: Fit) -> dict[str, KeptQuantized]:
    """The model's linears (by module path) whose weights the file stores quantized and that stay quantized in
    memory (``nn.Linear`` modules the model does not keep in float32); other quantized tensors are dequantized as
    they load."""
    from torch import nn

    from diffpipe_core.engine.model_loading import keeps_float32, key_targets
    from diffpipe_core.quantized_files import scale_shape

    modules = dict(model.named_modules())
    plan: dict[str, KeptQuantized] = {}
    for layer in file.quantized.values():
        if layer.nvfp4:  # dequantized as it loads: no ScaledLinear holds packed FP4 with block scales
            continue
        per_row = layer.scale is not None and len(scale_shape(file.tensors[layer.scale][1])) == 2
        for name, _ in key_targets(fit.key_map(layer.weight)):
            module_name = name.removesuffix(".weight")
            module = modules.get(module_name)
            if type(module) is not nn.Linear or keeps_float32(model, name):
                continue
            shape = (module.out_features, 1) if per_row else ()
            plan[module_name] = KeptQuantized(layer.storage, shape, per_row, layer.scale is not None, layer.rotation)
    return plan


def keep_quantized(model: nn.Module, plan: Mapping[str, KeptQuantized], compute_dtype: torch.dtype) -> nn.Module:
    """Replace each planned linear of ``model`` (a skeleton) by an empty
    :class:`~diffpipe_core.quantize.ScaledLinear` that loading fills with the stored weight and its scale."""
    from diffpipe_core.quantize import GGUFLinear, ScaledLinear
    from diffpipe_core.quantized_files import storage_dtype

    for module_name, kept in plan.items():
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        if kept.storage.startswith("gguf:"):
            setattr(parent, child, GGUFLinear.like(linear, kept.storage.removeprefix("gguf:"), compute_dtype))
            continue
        scale = kept.scale_shape if kept.scaled else None
        stored = ScaledLinear.like(linear, storage_dtype(kept.storage), scale, compute_dtype, kept.rotation)
        setattr(parent, child, stored)
    return model


def quantized_key_map(
    file: ComponentFile,
    key_map: Callable[[str], Any],
    plan: Mapping[str, KeptQuantized],
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> Any:
    """``key_map`` (file key -> model tensors) for a quantized file: a weight kept quantized loads as stored (a legacy
    uint8 container viewed as its float8 type) with its scale into ``weight_scale``; any other quantized weight loads
    dequantized (an NVFP4 one cut back to the model's ``shapes`` where its file pads it); quantization markers and
    input scales load nowhere."""
    import torch

    from diffpipe_core.engine.model_loading import key_targets
    from diffpipe_core.quantized_files import dequantizing, storage_dtype

    by_scale = {layer.scale: layer for layer in file.quantized.values() if layer.scale}
    by_weight = {layer.weight: layer for layer in file.quantized.values()}

    def mapped(key: str) -> Any:
        if key in by_scale:
            layer = by_scale[key]
            made = []
            for name, fn in key_targets(key_map(layer.weight)):
                kept = plan.get(name.removesuffix(".weight"))
                if kept is not None:
                    made.append((f"{name.removesuffix('.weight')}.weight_scale", _scale_part(fn, kept)))
            return made or None
        layer = by_weight.get(key)
        if layer is None:
            return None if is_side_key(key) or is_scale_key(key) else key_map(key)
        made = []
        store = torch.uint8 if layer.gguf else storage_dtype(layer.storage)
        for name, fn in key_targets(key_map(key)):
            if name.removesuffix(".weight") in plan:
                made.append((name, _as_stored(store, fn)))
            else:
                whole = dequantizing(file.path, layer, torch.float32)
                if layer.nvfp4 and fn is None:
                    whole = _unpadded(whole, (shapes or {}).get(name))
                made.append((name, (lambda t, fn=fn, whole=whole: fn(whole(t))) if fn else whole))
        return made

    return mapped


def _unpadded(whole: Callable[[Any], Any], shape: tuple[int, ...] | None) -> Callable[[Any], Any]:
    """``whole`` (an NVFP4 weight's dequantization) cut back to the model's ``shape`` (its file pads it to 16s)."""
    from diffpipe_core.quantized_files import unpad

    return lambda t: unpad(whole(t), shape)


def _as_stored(store: Any, fn: Any) -> Any:
    """A kept weight as stored (a legacy uint8 container viewed as its float8 type), cut by ``fn`` on its bytes (a
    layout's transforms only move data)."""
    import torch

    def load(t: Any) -> Any:
        t = t if t.dtype == store else t.view(store)
        return t if fn is None else fn(t.view(torch.uint8)).view(store)

    return load


def _scale_part(fn: Any, kept: KeptQuantized) -> Any:
    """A stored scale for a kept linear: its rows of a per-row scale (the weight's own cut), one value as is."""
    from diffpipe_core.quantized_files import as_scale

    if kept.per_row:
        return (lambda t: fn(as_scale(t))) if fn else as_scale
    return as_scale


@dataclass(frozen=True)
class DiffusionModelFile:
    """A ``diffusion_model`` file as the model reads it: its header, how its keys fit (None: they fit neither
    diffusers' names nor the original layout), the linears that keep its quantized weights, and the key map for
    loading."""

    file: ComponentFile
    fit: Fit | None
    plan: dict[str, KeptQuantized]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # the model's, to cut padded NVFP4 weights

    @property
    def gguf(self) -> bool:
        return is_gguf(self.file.path)

    @property
    def key_map(self) -> Callable[[str], Any]:
        assert self.fit is not None
        if not self.file.quantized:
            return self.fit.key_map
        return quantized_key_map(self.file, self.fit.key_map, self.plan, self.shapes)


def describe_diffusion_model(path: Path, skeleton: nn.Module, tables: Sequence[KeyTable]) -> DiffusionModelFile:
    """:class:`DiffusionModelFile` of ``path`` for a model built as ``skeleton`` (on meta)."""
    file = read_component_file(path, "diffusion_model")
    shapes = model_shapes(skeleton)
    fit = fit_file(file, shapes, tables, tied_names(skeleton))
    plan = quantized_plan(skeleton, file, fit) if fit is not None and file.quantized else {}
    return DiffusionModelFile(file, fit, plan, shapes)


def fill_whole(model: nn.Module, path: Path, key_map: Callable[[str], Any], device: Any) -> nn.Module:
    """Fill every tensor of ``model`` (a skeleton on meta) from file ``path`` through ``key_map``, each in its
    skeleton dtype, on ``device``; raises ValueError naming the file and the tensors it lacks."""
    from diffpipe_core.engine.model_loading import fill_in_place, key_targets, meta_tensors
    from diffpipe_core.weight_files import open_weights

    wanted = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with open_weights(path, str(device)) as f:
        for key in f.keys():
            for name, transform in key_targets(key_map(key)):
                if name in wanted:
                    value = f.get_tensor(key)
                    value = transform(value) if transform else value
                    fill_in_place(wanted[name], value.to(wanted[name].dtype))
    missing = meta_tensors(model)
    if missing:
        raise ValueError(f"{path}: {len(missing)} of the model's tensors are not in the file, e.g. {missing[:3]}")
    return model.to(device)
