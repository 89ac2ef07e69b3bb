"""The plugin conformance kit: contract checks a model plugin runs in its own tests.

    from diffpipe_core.testing.conformance import check_model_plugin
    check_model_plugin(my_plugin_module, "mymodel", {"type": "mymodel", "path": str(tiny_model_dir)},
                       pixels=torch.rand(2, 3, 64, 64) * 2 - 1, captions=["a cat", "a dog"])

Each check raises AssertionError naming the hook and what is wrong.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from diffpipe_core.adapters import apply_lora, lora_config
from diffpipe_core.engine.model_loading import load_for_stages, materialise_layers
from diffpipe_core.registry import Registry
from diffpipe_core.schema import validate
from diffpipe_core.types import EncodeBatch, ModelConfigBase, ModelSpec, TrainingContext


def _check_encoded(out: Any, batch_size: int, hook: str) -> dict[str, torch.Tensor]:
    assert isinstance(out, dict) and out, f"{hook} must return a non-empty dict of tensors, got {type(out).__name__}"
    for key, value in out.items():
        assert not key.startswith("_"), f"{hook}: key {key!r} must not start with '_'"
        assert torch.is_tensor(value), f"{hook}: {key!r} is {type(value).__name__}, not a tensor"
        assert value.shape[0] == batch_size, f"{hook}: {key!r} has batch dim {value.shape[0]}, expected {batch_size}"
        assert torch.isfinite(value.float()).all(), f"{hook}: {key!r} holds non-finite values"
    return out


def _run_layers(layers: list[nn.Module], inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    x = inputs
    for i, layer in enumerate(layers):
        x = layer(x)
        assert isinstance(x, tuple) and all(torch.is_tensor(t) for t in x), (
            f"split_into_layers: layer {i} ({type(layer).__name__}) must return a tuple of tensors"
        )
    return x


def check_model_plugin(
    plugin_obj: Any,
    name: str,
    model_table: dict[str, Any],
    pixels: torch.Tensor,
    captions: list[str],
    seed: int = 0,
) -> None:
    """Run every contract check on one model plugin with a tiny model; see the module docstring."""
    registry = Registry()
    info = registry.register_model(name, plugin_obj)
    assert info.ok, f"model_spec failed: {info.error}"
    plugin = registry.model(name)
    spec = plugin.spec
    assert isinstance(spec, ModelSpec) and spec.modality in ("image", "video")
    assert issubclass(spec.config_schema, ModelConfigBase), "config_schema must subclass ModelConfigBase"
    assert spec.spatial_multiple > 0 and spec.frame_multiple > 0
    for key in spec.encoder_settings:
        assert key in spec.config_schema.model_fields, f"encoder_settings names unknown [model] key {key!r}"
    cfg = validate(spec.config_schema, model_table, f"[model] of {name}")

    device = torch.device("cpu")
    encoders = plugin.require("load_encoders", model_config=cfg, device=device)
    n = pixels.shape[0]
    assert len(captions) == n, "give one caption per pixel sample"
    media = _check_encoded(
        plugin.require("encode_batch", encoders=encoders, batch=EncodeBatch(pixels=pixels)), n, "encode_batch(pixels)"
    )
    text = _check_encoded(
        plugin.require("encode_batch", encoders=encoders, batch=EncodeBatch(captions=captions)),
        n,
        "encode_batch(captions)",
    )
    again = plugin.require("encode_batch", encoders=encoders, batch=EncodeBatch(captions=captions))
    for key, value in text.items():
        assert torch.equal(value, again[key]), f"encode_batch: the same caption gave a different {key!r}"
    assert not set(media) & set(text), f"media and caption keys overlap: {set(media) & set(text)}"
    del encoders

    dtype = torch.float32
    stage = load_for_stages(plugin, cfg, device, dtype)
    if stage.per_stage_loading:
        materialise_layers(plugin, cfg, stage, range(len(stage.layers)), device, dtype)
        full = plugin.require("load_diffusion_model", model_config=cfg, device=device, dtype=dtype)
        mine, theirs = stage.model.state_dict(), full.state_dict()
        assert mine.keys() == theirs.keys(), "per-stage loading: keys differ from a full load"
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), f"per-stage loading: {key!r} differs from a full load"
    model, layers = stage.model, stage.layers
    owned = {id(p) for p in model.parameters()}
    for i, layer in enumerate(layers):
        assert isinstance(layer, nn.Module), f"split_into_layers: layer {i} is not an nn.Module"
        for p in layer.parameters():
            assert id(p) in owned, f"split_into_layers: layer {i} holds a parameter that is not the model's"

    batch = {**media, **text}
    context = TrainingContext(model_config=cfg)
    first = plugin.require(
        "prepare_inputs", batch=batch, context=context, generator=torch.Generator().manual_seed(seed)
    )
    second = plugin.require(
        "prepare_inputs", batch=batch, context=context, generator=torch.Generator().manual_seed(seed)
    )
    for a, b in zip(first[0] + first[1], second[0] + second[1]):
        assert torch.equal(a, b), "prepare_inputs must draw all randomness from the generator it is given"

    targets = plugin.require("lora_targets", model_config=cfg)
    apply_lora(model, lora_config(4, 4, 0.0, list(targets)))
    with torch.no_grad():
        for n_, p in model.named_parameters():
            if "lora_B" in n_:
                p.normal_(std=0.01)
    inputs, loss_targets = first
    outputs = _run_layers(layers, tuple(t.clone() for t in inputs))
    loss = plugin.require("compute_loss", outputs=outputs, targets=loss_targets)
    assert torch.is_tensor(loss) and loss.dim() == 0 and torch.isfinite(loss), f"compute_loss returned {loss!r}"
    loss.backward()
    lora_params = [(n_, p) for n_, p in model.named_parameters() if "lora_" in n_]
    assert lora_params, f"lora_targets {targets} matched no module"
    without_grad = [n_ for n_, p in lora_params if p.grad is None or not p.grad.abs().sum() > 0]
    assert not without_grad, f"LoRA weights get no gradient through the layers, e.g. {without_grad[:3]}"
