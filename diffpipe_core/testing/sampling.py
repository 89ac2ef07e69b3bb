"""Comparing diffpipe's samples with a diffusers pipeline's, in plugins' tests."""

from __future__ import annotations

from typing import Any

import torch

from diffpipe_core.sampling.loop import generate, noise_generator
from diffpipe_core.sampling.pipeline import LayerChainForward
from diffpipe_core.types import SampleRequest

CPU = torch.device("cpu")


def registered(plugin: Any, name: str | None = None) -> Any:
    """The model plugin object ``plugin`` registered alone, under ``name`` (default: its spec's name), as the
    registry's model handle (``require``, ``has``) the core's sampling code takes."""
    from diffpipe_core.registry import Registry

    registry = Registry()
    name = name or plugin.model_spec().name
    info = registry.register_model(name, plugin)
    assert info.ok, info.error
    return registry.model(name)


def sample_latents(
    plugin: Any,
    model_config: Any,
    request: SampleRequest,
    texts: Any,
    seed: int,
    cfg_scale: float = 1.0,
    device: torch.device = CPU,
) -> torch.Tensor:
    """diffpipe's sample of one prompt (``texts``, from ``encode_prompts``): the core's loop over the registered
    ``plugin``'s layers (the whole model on ``device`` in float32) from the noise of ``noise_generator(seed, 0)``;
    the final latents (on the CPU)."""
    model = plugin.require("load_diffusion_model", model_config=model_config, device=device, dtype=torch.float32)
    layers = plugin.require("split_into_layers", model=model, model_config=model_config)
    forward = LayerChainForward(layers, device)
    (latents,) = generate(plugin, model_config, request, [texts], [noise_generator(seed, 0)], forward, cfg=cfg_scale)
    return latents


def assert_same_sample(ours: torch.Tensor, expected: torch.Tensor, noise: torch.Tensor) -> None:
    """``ours`` equals the pipeline's ``expected`` latents, and it is far from the ``noise`` both started from (so
    a loop that denoised nothing cannot pass)."""
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    assert (ours - noise).abs().max() > 0.1, "the sample is still its starting noise"
