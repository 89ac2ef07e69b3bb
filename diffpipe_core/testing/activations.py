"""For plugin tests: the stage plan's meta-device activation measurement against a real forward.

    from diffpipe_core.testing.activations import check_meta_activations
    check_meta_activations(model, layers, inputs, lora_targets)   # a real (CPU) model and its pipeline layers

The layers run twice from ``inputs`` (the first layer's inputs of a real micro-batch): on a meta twin of the model
(what ``partition_method = "memory"`` measures) and for real, with the same LoRA on both; per layer, the bytes
autograd keeps for backward must agree within ``tolerance``. A layer that cannot run on the meta device fails
the check by name.
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.adapters import apply_lora, lora_config
from diffpipe_core.engine.activations import measure_layers, storage_bytes, storage_id
from diffpipe_core.engine.stage_costs import meta_twin


def real_saved_bytes(model: nn.Module, layers: list[nn.Module], inputs: tuple[torch.Tensor, ...]) -> list[int]:
    """Per layer, the bytes (each storage once, weights left out) autograd keeps in a real forward."""
    weights = {storage_id(t) for t in [*model.parameters(), *model.buffers()]}
    x = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs)
    out, alive = [], []
    for layer in layers:
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            if storage_id(t) not in weights:
                saved[storage_id(t)] = storage_bytes(t)
                alive.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = layer(x)
        out.append(sum(saved.values()))
    return out


def check_meta_activations(
    model: nn.Module,
    layers: list[nn.Module],
    inputs: tuple[torch.Tensor, ...],
    lora_targets: list[str],
    tolerance: float = 0.02,
) -> list[tuple[int, int]]:
    """Assert the meta measurement of each layer is within ``tolerance`` of the real one; returns the pairs
    ``(real, meta)``. ``model`` gets a LoRA (rank 4) on ``lora_targets``."""
    twin, twin_layers = meta_twin(model, layers)
    config = lora_config(4, 4, 0.0, list(lora_targets))
    apply_lora(twin, config)
    for name, p in twin.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(torch.float32)  # what apply_lora does to real LoRA weights
    measured = measure_layers(twin_layers, inputs)
    assert measured.failed is None, f"the meta forward failed at {measured.failed}"
    apply_lora(model, config)
    real = real_saved_bytes(model, layers, inputs)
    pairs = [(r, sum(m.saved.values())) for r, m in zip(real, measured.layers)]
    for i, (r, m) in enumerate(pairs):
        assert abs(m - r) <= tolerance * r + 1024, (
            f"layer {i} ({type(layers[i]).__name__}) keeps {r} bytes for backward; the meta forward counts {m}"
        )
    return pairs
