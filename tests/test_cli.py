"""`diffpipe data` and `diffpipe cache` through the real CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_core.testing.processes import cli_env, run_diffpipe
from diffpipe_core.testing.runs import run_toml
from diffpipe_reference.model import write_tiny_model

MODEL = {"type": "reference", "path": "model"}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    write_tiny_model(tmp_path / "model")
    write_image_dataset(tmp_path / "images", 5, size=[(64, 64)] * 3 + [(128, 64)] * 2)
    (tmp_path / "images" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "images", resolutions=[64], enable_ar_bucket=True)
    (tmp_path / "run.toml").write_text(run_toml(MODEL, {}, micro_batch_size_per_gpu=2))
    return tmp_path


def test_data_command_lists_buckets_and_left_out_files(project: Path) -> None:
    result = run_diffpipe(["data", "--config", "run.toml"], cwd=project, timeout=120)
    assert result.returncode == 0, result.output
    assert "64x64" in result.stdout and "broken.png" in result.stdout
    # issue 28: and the stage plan (the dataset is not cached yet: weights and trainable state only)
    assert "stage plan (memory, 1 stage; activations: not estimated: the dataset is not cached yet" in result.stdout
    assert "0-5 (EmbedLayer, BlockLayer x4, FinalLayer)" in result.stdout


def test_validate_prints_the_stage_plan_and_warns_of_an_uneven_split(project: Path) -> None:
    run2 = run_toml(MODEL, {}, micro_batch_size_per_gpu=2, pipeline_stages=2, partition_split=[1])
    (project / "run2.toml").write_text(run2)
    # on a CPU the plan adds each worker's C heap (19 MiB + 4.3%), which evens out this tiny model's stages; with
    # malloc's mmap threshold fixed it counts none, and the split's own unevenness shows
    fixed = cli_env(MALLOC_MMAP_THRESHOLD_=str(128 * 2**10))
    result = run_diffpipe(["validate", "--config", "run2.toml"], cwd=project, timeout=120, env=fixed)
    assert result.returncode == 0, result.output
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("stage plan (explicit, 2 stages"))
    assert lines[header + 2].startswith("  0 ") and lines[header + 2].endswith("0 (EmbedLayer)")
    assert lines[header + 3].endswith("1-5 (BlockLayer x4, FinalLayer)")
    assert lines[header + 4].startswith("  warning: stage 1 is estimated at")
    assert "above the mean of the stages" in lines[header + 4]


@pytest.mark.slow
def test_cache_command_encodes_once_then_reuses(project: Path) -> None:
    first = run_diffpipe(["cache", "--config", "run.toml", "--num-procs", "2"], cwd=project, timeout=300)
    assert first.returncode == 0, first.output[-3000:]
    assert "media encoded 5, reused 0" in first.output and "captions encoded 5, reused 0" in first.output
    assert first.output.count("broken.png") == 1, first.output  # issue 20.13: warned once, not once per scan
    assert "caching 3 media + 3 captions" in first.output  # issue 20.21: rank 0's share, both kinds counted
    second = run_diffpipe(["cache", "--config", "run.toml", "--num-procs", "1"], cwd=project, timeout=300)
    assert second.returncode == 0, second.output[-3000:]
    assert "media encoded 0, reused 5" in second.output and "captions encoded 0, reused 5" in second.output
    # issue 28: once cached, the plan estimates activations for a micro-batch of the largest bucket (64x64: 8x8
    # latents, more than the 128x64 image's 80x48 bucket's 6x10)
    data = run_diffpipe(["data", "--config", "run.toml"], cwd=project, timeout=120)
    assert data.returncode == 0, data.output
    assert "stage plan (memory, 1 stage; activations: micro-batch of 2 in bucket 64x64)" in data.stdout
