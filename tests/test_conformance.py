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
from diffpipe_reference.variants import ReferenceSampling, ReferenceTraining


def check_reference(plugin, folder: Path, width: int = 48) -> None:
    """The kit on ``plugin`` (the reference model or a variant) with the tiny model in ``folder``, 32 x ``width``."""
    write_tiny_model(folder)
    table, pixels = {"type": "reference", "path": folder}, torch.rand(2, 3, 32, width) * 2 - 1
    check_model_plugin(plugin, "reference", table, pixels=pixels, captions=["a cat", "a dog"])


def test_reference_plugin_conforms(tmp_path: Path) -> None:
    check_reference(reference, tmp_path / "m")


class UnseededNoise(ReferenceTraining):
    """The reference model, but prepare_inputs also uses the global RNG: pipeline stages would disagree."""

    @hookimpl
    def prepare_inputs(self, batch, context, generator):
        inputs, targets = reference.prepare_inputs(batch, context, generator)
        return (inputs[0] + torch.randn_like(inputs[0]),) + inputs[1:], targets


def test_kit_catches_unseeded_randomness(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="randomness from the generator"):
        check_reference(UnseededNoise(), tmp_path / "m", width=32)


class FixedSizeSampler(ReferenceSampling):
    """The reference model, but its sampling noise is always 64x64 pixels' worth, whatever the request says."""

    @hookimpl
    def denoise_init(self, request, model_config, generator):
        return reference.denoise_init(dataclasses.replace(request, width=64, height=64), model_config, generator)


def test_kit_checks_the_sample_size(tmp_path: Path) -> None:
    """A plugin that declares sampling must produce the requested size (and, for videos, frame count)."""
    with pytest.raises(AssertionError, match=r"sampling \(48x32, 1 frame\): decode_latents gave a sample of shape "
                       r"\(3, 64, 64\); the request needs \(3, 32, 48\)"):
        check_reference(FixedSizeSampler(), tmp_path / "m")
