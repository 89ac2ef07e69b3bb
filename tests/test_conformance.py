"""The reference plugin passes the conformance kit, and the kit catches a broken plugin."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import diffpipe_reference.plugin as reference
from diffpipe_core import hookimpl
from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_reference.model import write_tiny_model


def test_reference_plugin_conforms(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "m")
    check_model_plugin(
        reference,
        "reference",
        {"type": "reference", "path": tmp_path / "m"},
        pixels=torch.rand(2, 3, 32, 48) * 2 - 1,
        captions=["a cat", "a dog"],
    )


class UnseededNoise:
    """The reference model, but prepare_inputs also uses the global RNG: pipeline stages would disagree."""

    model_spec = staticmethod(reference.model_spec)
    load_encoders = staticmethod(reference.load_encoders)
    encode_batch = staticmethod(reference.encode_batch)
    load_diffusion_model = staticmethod(reference.load_diffusion_model)
    diffusion_model_weights = staticmethod(reference.diffusion_model_weights)
    split_into_layers = staticmethod(reference.split_into_layers)
    compute_loss = staticmethod(reference.compute_loss)
    lora_targets = staticmethod(reference.lora_targets)

    @hookimpl
    def prepare_inputs(self, batch, context, generator):
        inputs, targets = reference.prepare_inputs(batch, context, generator)
        return (inputs[0] + torch.randn_like(inputs[0]),) + inputs[1:], targets


def test_kit_catches_unseeded_randomness(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "m")
    with pytest.raises(AssertionError, match="randomness from the generator"):
        check_model_plugin(
            UnseededNoise(),
            "reference",
            {"type": "reference", "path": tmp_path / "m"},
            pixels=torch.rand(2, 3, 32, 32) * 2 - 1,
            captions=["a", "b"],
        )
