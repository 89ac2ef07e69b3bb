"""The {{name}} plugin against diffpipe's conformance kit and its own checks,
on a tiny random-weight model written to disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffpipe_core.testing.conformance import check_model_plugin

import {{package}}.plugin as plugin
from {{package}}.model import write_tiny_model

CAPTIONS = ["a red cat", "a blue dog"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("{{name}}") / "model")


def table(model_dir: Path) -> dict:
    return {"type": "{{name}}", "path": str(model_dir)}


def test_conforms(model_dir: Path) -> None:
    """The kit checks fast start (no torch at import), encodes a media batch (a video model: a video batch
    and its first frame as an image batch, with masks) and a caption batch, loads per stage and whole, and
    trains the layers with LoRA."""
    spec = plugin.model_spec()
    if spec.modality == "video":
        pixels = torch.rand(2, 3, spec.frame_multiple + spec.frame_offset, 32, 32)
    else:
        pixels = torch.rand(2, 3, 32, 48)
    check_model_plugin(plugin, plugin.NAME, table(model_dir), pixels=pixels * 2 - 1, captions=CAPTIONS)


def test_masks_weight_the_loss(model_dir: Path) -> None:
    """A (B, 1, H, W) mask (the same for every frame of a video) reaches compute_loss at the latent size."""
    from diffpipe_core.types import EncodeBatch, TrainingContext

    cfg = plugin.model_spec().config_schema(**table(model_dir))
    encoders = plugin.load_encoders(cfg, torch.device("cpu"))
    masks = torch.zeros(2, 1, 32, 32)
    masks[:, :, :, :16] = 1
    spec = plugin.model_spec()
    batches = [torch.rand(2, 3, 32, 32)]  # images are 4-D, also in a video model
    if spec.modality == "video":
        batches.append(torch.rand(2, 3, spec.frame_multiple + spec.frame_offset, 32, 32))
    for pixels in batches:
        media = plugin.encode_batch(encoders, EncodeBatch(pixels=pixels * 2 - 1, masks=masks))
        text = plugin.encode_batch(encoders, EncodeBatch(captions=CAPTIONS))
        context = TrainingContext(model_config=cfg)
        _, targets = plugin.prepare_inputs({**media, **text}, context, torch.Generator().manual_seed(0))
        target, mask = targets
        assert mask.dim() == target.dim() and mask.shape[-2:] == target.shape[-2:]
        right_half_wrong = target.clone()
        right_half_wrong[..., target.shape[-1] // 2 :] += 5.0
        assert plugin.compute_loss((right_half_wrong,), targets, context) == 0  # only the masked-out half differs


def test_validate_model_files(model_dir: Path, tmp_path: Path) -> None:
    assert plugin.validate_model_files(plugin.model_spec().config_schema(**table(model_dir))) == []
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    problems = plugin.validate_model_files(plugin.model_spec().config_schema(**table(broken)))
    assert any("transformer.safetensors is missing" in p and str(broken) in p for p in problems), problems
