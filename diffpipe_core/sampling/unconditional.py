"""The frozen second model of the unconditional branch (``ModelSpec.unconditional_model``), for samples with
``[sample] cfg > 1``: loaded once per run on each pipeline's last stage into host memory (never for ``cfg = 1``, nor
for a model that does not declare one), cut into the plugin's layers, on the device only while a sampling point
denoises. The stage plan's line for it (:func:`~diffpipe_core.engine.plan_build.unconditional_line`) counts its
bytes on the last stage (:func:`unconditional_bytes`)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from diffpipe_core.registry import ModelPlugin
from diffpipe_core.sampling.pipeline import LayerChainForward
from diffpipe_core.types import ModelConfigBase

HOST = torch.device("cpu")


def runs_unconditional(plugin: ModelPlugin, cfg_scale: float) -> bool:
    """Whether samples at guidance ``cfg_scale`` run the plugin's declared unconditional model."""
    return cfg_scale > 1.0 and plugin.spec.unconditional_model is not None


def _dtype(model_config: ModelConfigBase) -> torch.dtype:
    from diffpipe_core.engine.stage_costs import DTYPES

    return DTYPES[getattr(model_config, "dtype", "float32")]


def unconditional_bytes(plugin: ModelPlugin, model_config: ModelConfigBase) -> int:
    """The unconditional model's weight bytes (its state dict) in the run's ``dtype``, from its skeleton on ``meta``
    (reads no weight)."""
    model = plugin.require(
        "load_unconditional_model", model_config=model_config, device=torch.device("meta"), dtype=_dtype(model_config)
    )
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


class HeldUnconditional:
    """The unconditional model of the rank that runs it; ``with held.forward() as run:`` has it on the device."""

    def __init__(self, plugin: ModelPlugin, model_config: ModelConfigBase, device: torch.device) -> None:
        self.plugin, self.model_config, self.device = plugin, model_config, device
        self.model: nn.Module | None = None
        self.layers: list[nn.Module] = []

    def load(self) -> None:
        """Load the model into host memory now (the sampler does at its start: a missing file fails the run before
        training, not at its first sampling point)."""
        if self.model is not None:
            return
        model = self.plugin.require(
            "load_unconditional_model", model_config=self.model_config, device=HOST, dtype=_dtype(self.model_config)
        )
        model.requires_grad_(False).eval()
        self.layers = list(self.plugin.require("split_into_layers", model=model, model_config=self.model_config))
        self.model = model

    @contextmanager
    def forward(self) -> Iterator[Any]:
        """The model's layers chained on the device (:class:`LayerChainForward`), moved back to host memory after."""
        self.load()
        assert self.model is not None
        moved = self.device.type != HOST.type
        if moved:
            self.model.to(self.device)
        try:
            yield LayerChainForward(self.layers, self.device)
        finally:
            if moved:
                self.model.to(HOST)
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()


@contextmanager
def unconditional_forward(
    plugin: ModelPlugin, model_config: ModelConfigBase, cfg_scale: float, device: torch.device
) -> Iterator[Any]:
    """For one process's samples at ``cfg_scale`` (tests, the conformance kit): the declared unconditional model's
    forward on ``device`` when it runs (:func:`runs_unconditional`), else None; freed after."""
    if not runs_unconditional(plugin, cfg_scale):
        yield None
        return
    with HeldUnconditional(plugin, model_config, device).forward() as run:
        yield run
