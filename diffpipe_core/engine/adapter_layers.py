"""An adapter (LoRA, LoKr, LoHa) on a model that is already cut into pipeline layers.

peft injects a LoRA by replacing the targeted module in its parent. A layer that holds a module directly (Flux's
``x_embedder``, a final ``proj_out``: ``self.proj_out = model.proj_out``) keeps the module it was given, now the
LoRA's ``base_layer``, so the LoRA would never run and its ``lora_B`` would stay zero. After injecting we point
every layer at the LoRA wrappers instead (:func:`rewire_layers`), for every plugin, and refuse a targeted module
that no layer holds; the first optimizer step then checks that each LoRA tensor got a gradient
(:func:`lora_without_gradient`), so a module the layers hold but never call is named too.
"""

from __future__ import annotations

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from diffpipe_core.adapter_kinds import is_adapter_param
from diffpipe_core.adapters import apply_adapter


def adapt_layers(model: nn.Module, layers: list[nn.Module], config, dtype: torch.dtype) -> None:
    """Inject ``config``'s adapter into ``model`` (:func:`~diffpipe_core.adapters.apply_adapter`) so that
    ``layers``, cut from ``model`` before, run it; raise ValueError naming adapted modules no layer holds."""
    apply_adapter(model, config, dtype)
    rewire_layers(model, layers)
    held = {id(m) for layer in layers for m in layer.modules()}
    stray = [name for name, m in model.named_modules() if isinstance(m, BaseTunerLayer) and id(m) not in held]
    if stray:
        shown = ", ".join(stray[:5]) + (f" and {len(stray) - 5} more" if len(stray) > 5 else "")
        raise ValueError(
            f"LoRA target_modules {sorted(config.target_modules)} match {shown}, which no pipeline layer uses, so "
            "their LoRA would never train; leave them out of [adapter] target_modules"
        )


def rewire_layers(model: nn.Module, layers: list[nn.Module]) -> int:
    """Replace, inside each layer, every reference to a module peft wrapped by its LoRA wrapper; the count."""
    wrapper_of = {id(m.get_base_layer()): m for m in model.modules() if isinstance(m, BaseTunerLayer)}
    replaced = 0
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        nonlocal replaced
        if id(module) in seen or isinstance(module, BaseTunerLayer):
            return
        seen.add(id(module))
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            wrapper = wrapper_of.get(id(child))
            if wrapper is not None:
                module._modules[name] = wrapper
                replaced += 1
            else:
                visit(child)

    for layer in layers:
        visit(layer)
    return replaced


def lora_without_gradient(named: dict[str, torch.Tensor], groups: list[list[torch.Tensor]] | None = None) -> list[str]:
    """The adapter tensors among ``named`` (trainable tensors by name) that got no gradient: not in the forward
    path. With ``groups`` (the optimizer's parameter groups' tensors), a group none of whose tensors got a gradient sat
    the step out (a network the step's samples did not use, as one of Wan 2.2 A14B's two experts) and is not named."""
    idle = {id(p) for group in groups or [] if all(p.grad is None for p in group) for p in group}
    return [n for n, p in named.items() if is_adapter_param(n) and p.grad is None and id(p) not in idle]
