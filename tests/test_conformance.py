"""The reference plugin passes the conformance kit, and the kit catches a broken plugin."""

from __future__ import annotations

import dataclasses
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


class FixedSizeSampler(UnseededNoise):
    """The reference model, but its sampling noise is always 64x64 pixels' worth, whatever the request says."""

    prepare_inputs = staticmethod(reference.prepare_inputs)
    denoise_inputs = staticmethod(reference.denoise_inputs)
    denoise_step = staticmethod(reference.denoise_step)
    load_decoder = staticmethod(reference.load_decoder)
    decode_latents = staticmethod(reference.decode_latents)

    @hookimpl
    def denoise_init(self, request, model_config, generator):
        return reference.denoise_init(dataclasses.replace(request, width=64, height=64), model_config, generator)


def test_kit_checks_the_sample_size(tmp_path: Path) -> None:
    """A plugin that declares sampling must produce the requested size (and, for videos, frame count)."""
    write_tiny_model(tmp_path / "m")
    table = {"type": "reference", "path": tmp_path / "m"}
    pixels = torch.rand(2, 3, 32, 48) * 2 - 1
    with pytest.raises(AssertionError, match=r"sampling \(48x32, 1 frame\): decode_latents gave a sample of shape "
                       r"\(3, 64, 64\); the request needs \(3, 32, 48\)"):
        check_model_plugin(FixedSizeSampler(), "reference", table, pixels=pixels, captions=["a", "b"])
