"""The {{name}} plugin
against diffpipe's conformance kit and its own checks, on a tiny random-weight model written to disk in its real
diffusers layout (``testing.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from diffpipe_core.testing.conformance import check_model_plugin
from diffpipe_core.testing.fixtures import hf_offline  # noqa: F401  (autouse: no hub access)
from diffpipe_core.types import EncodeBatch, SampleRequest, TrainingContext

from {{package}}.plugin import plugin
from {{package}}.testing import write_tiny_model

CAPTIONS = ["a red cat", "a blue dog"]
SPEC = plugin.model_spec()
FRAMES = SPEC.frame_multiple + SPEC.frame_offset  # the shortest video


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("{{module}}") / "model")


def config(path: Path):
    table = {"type": "{{name}}", "path": path, "dtype": "float32", "encoder_dtype": "float32"}
    return SPEC.config_schema(**table)


def test_conforms(model_dir: Path) -> None:
    """The kit checks fast start (no torch at import), encodes a media batch (a video model: a video batch and its
    first frame as an image batch, with masks) and a caption batch, loads per stage and whole (nothing left on the
    meta device), and trains the layers with LoRA (every targeted module gets a gradient)."""
    pixels = torch.rand(2, 3, FRAMES, 32, 32) if SPEC.modality == "video" else torch.rand(2, 3, 32, 48)
    check_model_plugin(plugin, SPEC.name, {"type": SPEC.name, "path": str(model_dir)}, pixels * 2 - 1, CAPTIONS)


def test_masks_weight_the_loss(model_dir: Path) -> None:
    """A (B, 1, H, W) mask (the same for every frame of a video) reaches compute_loss at the latent size."""
    cfg = config(model_dir)
    encoders = plugin.load_encoders(cfg, torch.device("cpu"))
    masks = torch.zeros(2, 1, 32, 32)
    masks[:, :, :, :16] = 1
    batches = [torch.rand(2, 3, 32, 32)]  # images are 4-D, also in a video model
    if SPEC.modality == "video":
        batches.append(torch.rand(2, 3, FRAMES, 32, 32))
    text = plugin.encode_batch(encoders, EncodeBatch(captions=CAPTIONS))
    for pixels in batches:
        media = plugin.encode_batch(encoders, EncodeBatch(pixels=pixels * 2 - 1, masks=masks))
        context = TrainingContext(model_config=cfg)
        _, targets = plugin.prepare_inputs({**media, **text}, context, torch.Generator().manual_seed(0))
        target, mask = targets
        assert mask.dim() == target.dim() and mask.shape[-2:] == target.shape[-2:]
        right_half_wrong = target.clone()
        right_half_wrong[..., target.shape[-1] // 2 :] += 5.0
        assert plugin.compute_loss((right_half_wrong,), targets, context) == 0  # only the masked-out half differs


def test_validate_names_a_missing_component(model_dir: Path, tmp_path: Path) -> None:
    assert plugin.validate_model_files(config(model_dir)) == []
    broken = shutil.copytree(model_dir, tmp_path / "broken", ignore=shutil.ignore_patterns("vae"))
    problems = plugin.validate_model_files(config(broken))
    assert any(str(broken / "vae") in p and "{{vae_class}}" in p for p in problems), problems


@torch.no_grad()
def test_samples(model_dir: Path) -> None:
    """The sampling hooks denoise through the pipeline layers and decode to pixels in [-1, 1]."""
    cfg = config(model_dir)
    request = SampleRequest(width=32, height=32, frames=FRAMES if SPEC.modality == "video" else 1, steps=2)
    text = plugin.encode_batch(plugin.load_encoders(cfg, torch.device("cpu")), EncodeBatch(captions=CAPTIONS[:1]))
    layers = plugin.split_into_layers(plugin.load_diffusion_model(cfg, torch.device("cpu"), torch.float32), cfg)
    latents, schedule = plugin.denoise_init(request, cfg, torch.Generator().manual_seed(0))
    for index in range(request.steps):
        x = plugin.denoise_inputs(latents, schedule, index, text, request, cfg)
        for layer in layers:
            x = layer(x)
        latents = plugin.denoise_step(latents, x[0], schedule, index, cfg)
    pixels = plugin.decode_latents(plugin.load_decoder(cfg, torch.device("cpu")), latents)
    frames = (request.frames,) if SPEC.modality == "video" else ()
    assert pixels.shape == (1, 3, *frames, 32, 32) and pixels.abs().max() <= 1
