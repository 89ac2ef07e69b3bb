"""Build the diffusion model for one pipeline stage.

When the plugin implements ``diffusion_model_weights``, the model is built on the meta device, cut
into layers, partitioned, and only this stage's layers are filled in from the safetensors files, so
host RAM per rank falls with the number of stages. Otherwise the plugin loads the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from diffpipe_core.registry import ModelPlugin, PluginError
from diffpipe_core.types import ModelConfigBase


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


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    old = getattr(module, attr)
    if isinstance(old, nn.Parameter):
        setattr(module, attr, nn.Parameter(value, requires_grad=old.requires_grad))
    else:
        module._buffers[attr] = value


def materialise_layers(
    plugin: ModelPlugin,
    model_config: ModelConfigBase,
    stage: StageModel,
    layer_indices: range,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Read from the weight files exactly the tensors of ``layers[layer_indices]``."""
    names = _names_by_tensor_id(stage.model)
    wanted: dict[str, torch.Tensor] = {}
    for i in layer_indices:
        layer = stage.layers[i]
        for t in list(layer.parameters()) + list(layer.buffers()):
            name = names.get(id(t))
            if name is None:
                raise PluginError(
                    f"model plugin {plugin.name!r}: layer {i} holds a tensor that is not part of the model "
                    "(split_into_layers must wrap the model's own submodules)"
                )
            wanted[name] = t
    found: set[str] = set()
    for file, key_map in plugin.require("diffusion_model_weights", model_config=model_config):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                name = key_map(key)
                if name in wanted and name not in found:
                    current = wanted[name]
                    tensor = f.get_tensor(key)
                    target_dtype = dtype if current.is_floating_point() else current.dtype
                    _set_tensor(stage.model, name, tensor.to(target_dtype))
                    found.add(name)
    missing = [n for n, t in wanted.items() if n not in found and t.device.type == "meta"]
    if missing:
        raise PluginError(
            f"model plugin {plugin.name!r}: {len(missing)} tensors of this stage are not in the weight files, "
            f"e.g. {missing[:5]}"
        )
