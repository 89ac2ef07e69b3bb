"""Issue 20.9 and 20.10: mistakes found by `diffpipe validate` and before `train` does any work (no run folder),
each as one line naming the key and value: an unknown optimizer, gradient_accumulation_steps beyond what the
dataset gives, more pipeline stages than the model has layers, a string where a number belongs; and a resolution
the model rounds is said, with what it trains at. In-process through click's runner (the real commands)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from diffpipe_core.cli import main
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_reference.model import TinyDiTConfig, write_tiny_model

RUN = """
output_dir = "out"
dataset = "dataset.toml"
micro_batch_size_per_gpu = 2
gradient_accumulation_steps = {gas}
pipeline_stages = {stages}
[model]
type = "reference"
path = "model"
[adapter]
rank = 4
[optimizer]
type = {optimizer}
lr = {lr}
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("checks")
    write_tiny_model(root / "model")
    write_image_dataset(root / "images", 4, size=(64, 64))
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[64])
    return root


def _invoke(project: Path, command: str, *args: str, **keys: str):
    values = {"gas": "1", "stages": "1", "optimizer": '"adamw"', "lr": "1e-3", **keys}
    (project / "run.toml").write_text(RUN.format(**values))
    return CliRunner().invoke(main, [command, "--config", str(project / "run.toml"), *args])


def _refused(project: Path, expected: str, **keys: str) -> None:
    procs = keys.get("stages", "1")
    for command, args in (("validate", ()), ("train", ("--num-procs", procs))):
        result = _invoke(project, command, *args, **keys)
        assert result.exit_code == 1, result.output
        assert expected in result.stderr, result.stderr
        assert "Traceback" not in result.output
    assert not (project / "out").exists()  # train made no run folder


def test_an_unknown_optimizer_is_refused_before_work(project: Path) -> None:
    _refused(project, "optimizer.type: unknown optimizer 'adamw9'. Did you mean 'adamw'? Available: adamw, ",
             optimizer='"adamw9"')


def test_more_accumulation_steps_than_the_dataset_gives_are_refused_before_work(project: Path) -> None:
    # 4 images, 2 per micro-batch: 2 micro-batches an epoch (on 1 data-parallel rank; train below uses 2 stages x 1)
    _refused(project, "gradient_accumulation_steps: 3, but the dataset gives 2 micro-batches of 2 per epoch",
             gas="3", stages="2")


def test_more_stages_than_layers_are_refused_before_work(project: Path) -> None:
    layers = 2 + TinyDiTConfig().depth  # embed, the blocks, final
    _refused(project, f"pipeline_stages: {layers + 1}, but model 'reference' splits into {layers} layers",
             stages=str(layers + 1))


def test_optimizer_kwargs_it_does_not_take_are_refused_before_work(project: Path) -> None:
    _refused(project, "optimizer.kwargs: 'adamw' does not take ['bogus']; it takes: lr, betas, eps, weight_decay",
             lr="1e-3\nkwargs = { bogus = 1 }")


def test_optimizer_kwargs_of_the_wrong_type_are_refused_before_work(project: Path) -> None:
    _refused(project, "optimizer.kwargs.weight_decay: invalid value '0.1': a string, where a number is expected "
             "(default 0.01)", lr='1e-3\nkwargs = { weight_decay = "0.1" }')


def test_optimizer_kwargs_it_takes_pass(project: Path) -> None:
    result = _invoke(project, "validate", lr="1e-3\nkwargs = { amsgrad = true }", optimizer='"adamw"')
    assert result.exit_code == 0, result.output
    result = _invoke(project, "validate", lr="1e-3\nkwargs = { momentum = 0.9 }", optimizer='"sgd"')
    assert result.exit_code == 0, result.output


def test_a_string_for_a_number_is_refused(project: Path) -> None:
    result = _invoke(project, "validate", lr='"1e-4"')
    assert result.exit_code == 1
    assert "optimizer.lr: invalid value '1e-4': a string, where a number is expected; write it without quotes " \
           "(lr = 1e-4)" in result.stderr, result.stderr


def test_a_rounded_resolution_is_said_with_what_it_trains_at(project: Path) -> None:
    dataset = project / "dataset.toml"
    original = dataset.read_text()
    try:
        dataset.write_text(original.replace("resolutions = [64]", "resolutions = [72, [70, 50]]"))
        result = _invoke(project, "validate")
    finally:
        dataset.write_text(original)
    assert result.exit_code == 0, result.output
    assert f"{dataset}: resolutions: 72 is not a multiple of 16 (model 'reference'); training at 64x64" in result.stdout
    assert "resolutions: 70x50 is not a multiple of 16 (model 'reference'); training at 64x48" in result.stdout


def test_frame_buckets_on_an_image_model_are_said(project: Path) -> None:
    dataset = project / "dataset.toml"
    original = dataset.read_text()
    try:
        dataset.write_text(original.replace("resolutions = [64]", "resolutions = [64]\nframe_buckets = [1, 33]"))
        result = _invoke(project, "validate")
    finally:
        dataset.write_text(original)
    assert result.exit_code == 0, result.output
    assert f"{dataset}: frame_buckets: model 'reference' trains on images only, so [33] frames change nothing; " \
           "remove them" in result.stdout
