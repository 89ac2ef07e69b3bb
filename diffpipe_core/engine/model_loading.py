"""Build the diffusion model for one pipeline stage.

When the plugin implements ``diffusion_model_weights``, the model is built on the meta device, cut
into layers, partitioned, and only this stage's layers are filled in from the safetensors files, so
host RAM per rank falls with the number of stages. Otherwise the plugin loads the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from diffpipe_core.registry import ModelPlugin, PluginError
from diffpipe_core.types import ModelConfigBase
from diffpipe_core.weight_files import open_weights


@dataclass
class StageModel:
    model: nn.Module
    layers: list[nn.Module]
    per_stage_loading: bool


def load_for_stages(
    plugin: ModelPlugin, model_config: ModelConfigBase, device: torch.device, dtype: torch.dtype
) -> StageModel:
    """The diffusion model (maybe on meta) and its pipeline layers."""
    per_stage = plugin.has("diffusion_model_weights")
    build_device = torch.device("meta") if per_stage else device
    model = plugin.require("load_diffusion_model", model_config=model_config, device=build_device, dtype=dtype)
    layers = plugin.require("split_into_layers", model=model, model_config=model_config)
    if not layers:
        raise PluginError(f"model plugin {plugin.name!r}: split_into_layers returned no layers")
    return StageModel(model, list(layers), per_stage)


def _names_by_tensor_id(model: nn.Module) -> dict[int, str]:
    names = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        names.setdefault(id(t), name)
    return names


def fill_in_place(holder: torch.Tensor, value: torch.Tensor) -> None:
    """Give the existing tensor object ``holder`` the loaded data. Every module that holds it (a layer that
    re-uses a model's top-level parameter, say) then sees the loaded tensor, not a stale meta copy."""
    if isinstance(holder, nn.Parameter):
        value = nn.Parameter(value, requires_grad=holder.requires_grad)
    torch.utils.swap_tensors(holder, value)


def keeps_float32(model: nn.Module, name: str, dtype: torch.dtype | None = None) -> bool:
    """Whether ``from_pretrained`` keeps tensor ``name`` in float32 when loading in ``dtype``: diffusers keeps its
    ``_keep_in_fp32_modules`` so in any dtype; transformers keeps them only for float16, and its
    ``_keep_in_fp32_modules_strict`` for float16 and bfloat16 (T5's ``wo`` is bfloat16 in a bfloat16 load)."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    if hasattr(model, "_keep_in_fp32_modules_strict"):  # a transformers model
        keep = keep if dtype == torch.float16 else set()
        if dtype in (torch.float16, torch.bfloat16):
            keep |= set(model._keep_in_fp32_modules_strict or [])
    return any(part in keep for part in name.split("."))


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules the way diffusers' ``from_pretrained`` builds them before reading weights (accelerate's
    ``init_empty_weights``): every parameter on the meta device, while buffers and plain tensor attributes (RoPE
    tables a model computes in ``__init__`` and keeps as attributes, like Qwen-Image's) are computed for real on the
    CPU, since no weight file holds them. Parameters are moved to meta as they are registered, so their
    initialisation costs nothing."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def meta_tensors(model: nn.Module) -> list[str]:
    """Every tensor of ``model`` still on the meta device: parameters, buffers, and tensors modules keep as plain
    attributes (or in a list, tuple or dict attribute), by their path (``pos_embed.pos_freqs``)."""
    found = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    for module_name, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr in ("_parameters", "_buffers", "_modules"):
                continue
            where = f"{module_name}.{attr}" if module_name else attr
            if isinstance(value, dict):
                items = [(f"{where}[{k!r}]", v) for k, v in value.items()]
            elif isinstance(value, (list, tuple)):
                items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
            else:
                items = [(where, value)]
            found += [path for path, t in items if torch.is_tensor(t) and t.is_meta]
    return found


def cast_skeleton(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast a freshly built model's float tensors to ``dtype`` the way ``from_pretrained(torch_dtype=dtype)``
    does: modules in the model's ``_keep_in_fp32_modules`` stay float32. Use it on meta skeletons, so per-stage
    loading (which keeps each skeleton tensor's dtype) matches a whole ``from_pretrained`` load."""
    for module_name, module in model.named_modules():
        for store in (module._parameters, module._buffers):
            for attr, tensor in list(store.items()):
                if tensor is None or not tensor.is_floating_point():
                    continue
                full = f"{module_name}.{attr}" if module_name else attr
                target = torch.float32 if keeps_float32(model, full, dtype) else dtype
                if tensor.dtype != target:
                    cast = tensor.detach().to(target)
                    store[attr] = nn.Parameter(cast, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else cast
    return model


Transform = Callable[[torch.Tensor], torch.Tensor]
KeyTargets = str | None | Sequence[tuple[str, Transform | None]]


def key_targets(mapped: KeyTargets) -> list[tuple[str, Transform | None]]:
    """What a ``diffusion_model_weights`` key map returned, as ``[(model tensor name, transform or None)]``.

    A key map returns the model's name for a file key (1:1), None to skip the key, or a list of
    ``(model_name, transform)`` pairs when one file tensor makes several model tensors (a fused qkv split into
    q, k and v) or needs reshaping: ``transform`` turns the file tensor into that model tensor (None: as is).
    """
    if mapped is None:
        return []
    if isinstance(mapped, str):
        return [(mapped, None)]
    return list(mapped)


def materialise_layers(
    plugin: ModelPlugin,
    model_config: ModelConfigBase,
    stage: StageModel,
    layer_indices: Iterable[int],
    device: torch.device,
) -> None:
    """Read from the weight files exactly the tensors of ``layers[layer_indices]``.

    Each tensor is filled in place and keeps the dtype of the skeleton's tensor: the plugin built the
    skeleton in the run's dtype (with :func:`cast_skeleton`, float32-kept modules stay float32).
    """
    names = _names_by_tensor_id(stage.model)
    wanted: dict[str, torch.Tensor] = {}
    for i in layer_indices:
        layer = stage.layers[i]
        for own_name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
            name = names.get(id(t))
            if name is None:
                raise PluginError(
                    f"model plugin {plugin.name!r}: layer {i} ({type(layer).__name__}) holds {own_name!r}, "
                    "which is not the model's (split_into_layers must wrap the model's own submodules and "
                    "parameters, not copies)"
                )
            wanted[name] = t
    found: set[str] = set()
    for file, key_map in plugin.require("diffusion_model_weights", model_config=model_config):
        with open_weights(file, str(device)) as f:
            for key in f.keys():
                todo = [(n, fn) for n, fn in key_targets(key_map(key)) if n in wanted and n not in found]
                if not todo:
                    continue
                tensor = f.get_tensor(key)  # read once, only when this stage needs a tensor made from it
                for name, transform in todo:
                    current, value = wanted[name], transform(tensor) if transform else tensor
                    if tuple(value.shape) != tuple(current.shape):
                        made = f"the part of tensor {key!r} for {name!r}" if transform else f"tensor {key!r}"
                        raise PluginError(
                            f"{file}: {made} has shape {tuple(value.shape)}, but the model's {name!r} "
                            f"needs {tuple(current.shape)}"
                        )
                    fill_in_place(current, value.to(current.dtype))
                    found.add(name)
    missing = [n for n, t in wanted.items() if n not in found and t.device.type == "meta"]
    if missing:
        raise PluginError(
            f"model plugin {plugin.name!r}: {len(missing)} tensors of this stage are not in the weight files, "
            f"e.g. {missing[:5]}"
        )
