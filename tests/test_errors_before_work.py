"""Issue 9.3, 9.6, 9.7: errors are found before work, print one clear message (a traceback only with
``--debug``), leave no half-made run folder, and a rank failing while encoding stops the whole run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import diffpipe_reference.plugin as reference_plugin
from diffpipe_core.data import prepare_cache
from diffpipe_core.data.cache import CacheError
from diffpipe_core.registry import Registry
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_core.testing.processes import cli_env, run_diffpipe, write_plugin_distribution
from diffpipe_reference.model import write_tiny_model

RUN = """
output_dir = "out"
dataset = "dataset.toml"
micro_batch_size_per_gpu = 2
[model]
type = "reference"
path = "{model}"
"""

FAILER = '''
import os
from diffpipe_core import hookimpl

@hookimpl(wrapper=True)
def encode_batch(encoders, batch):
    if os.environ.get("RANK") == "1" and batch.pixels is not None:
        raise ValueError("img_003.png cannot be encoded here (simulated failure on rank 1)")
    return (yield)
'''


def _project(root: Path, model: str = "model", images: int = 4) -> Path:
    write_tiny_model(root / "model")
    write_image_dataset(root / "images", images, size=(64, 64))
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[64])
    (root / "run.toml").write_text(RUN.format(model=model))
    return root


def test_wrong_model_folder_is_found_by_validate_and_before_caching(tmp_path: Path) -> None:
    root = _project(tmp_path, model="not_a_model")
    wrong = root / "not_a_model"
    wrong.mkdir()
    (wrong / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    result = run_diffpipe(["validate", "--config", "run.toml"], cwd=root, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.output
    assert f"{wrong / 'config.json'}: not found" in result.stderr and "transformer.safetensors" in result.stderr

    registry = Registry()
    registry.register_model("reference", reference_plugin)
    plugin = registry.model("reference")
    config = plugin.spec.config_schema(type="reference", path=wrong)
    with pytest.raises(CacheError, match="do not fit model 'reference'"):
        prepare_cache(root / "dataset.toml", plugin, config, progress=False, decode_workers=0)
    assert not (root / "cache" / "reference").exists()  # no encoder was loaded, nothing encoded or written


def test_empty_dataset_fails_validate_and_train_makes_no_run_folder(tmp_path: Path) -> None:
    root = _project(tmp_path, images=1)
    (root / "images" / "img_000.txt").unlink()  # its only image has no caption: left out
    result = run_diffpipe(["validate", "--config", "run.toml"], cwd=root, timeout=120)
    assert result.returncode == 1 and "the dataset is empty" in result.stderr, result.output
    assert "run `diffpipe data` to list every file" in result.stderr
    result = run_diffpipe(["train", "--config", "run.toml"], cwd=root, timeout=120)
    assert result.returncode == 1 and "the dataset is empty" in result.stderr, result.output
    assert "Traceback" not in result.output
    assert not (root / "out").exists()
    # issue 9.12: `diffpipe data` itself lists the file and why, without telling the user to run itself
    result = run_diffpipe(["data", "--config", "run.toml"], cwd=root, timeout=120)
    assert result.returncode == 1 and "img_000.png" in result.stdout and "no caption" in result.stdout
    assert "1 file left out (1 no caption)" in result.stdout and "diffpipe data" not in result.output


def test_report_counts_read_naturally() -> None:
    from diffpipe_core.data.items import Bucket, MediaItem, ScanResult
    from diffpipe_core.data.report import format_report

    item = MediaItem(id="a.png", path=Path("a.png"), caption="c", bucket=Bucket(64, 64), content_key="k")
    assert "Summary: 1 file used, 1 item in 1 bucket, 0 files left out." in format_report(ScanResult([item]), 1, 1)


def test_user_error_is_one_message_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    root = _project(tmp_path)
    plain = run_diffpipe(["train", "--config", "run.toml", "--resume", "nowhere"], cwd=root, timeout=120)
    assert plain.returncode == 1 and "Traceback" not in plain.output
    assert plain.stderr.startswith("diffpipe: error: --resume nowhere: not a run folder"), plain.stderr
    debug = run_diffpipe(["--debug", "train", "--config", "run.toml", "--resume", "nowhere"], cwd=root, timeout=120)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "resolve_resume" in debug.stderr


@pytest.mark.slow
def test_a_rank_failing_while_encoding_stops_the_run_with_its_error(tmp_path: Path) -> None:
    root = _project(tmp_path, images=8)
    site = write_plugin_distribution(root / "site", "diffpipe-failer", {"diffpipe.plugins": {"f": "failer"}},
                                     {"failer": FAILER})
    start = time.monotonic()
    result = run_diffpipe(["cache", "--config", "run.toml", "--num-procs", "2"], cwd=root, timeout=300,
                          env=cli_env([site]))
    seconds = time.monotonic() - start
    assert result.returncode != 0
    # gloo's barrier timeout is 30 minutes; start-up under load takes ~10-40 s
    assert seconds < 120, f"the run took {seconds:.0f} s to stop"
    assert result.output.count("img_003.png cannot be encoded here") == 1, result.output[-3000:]
    assert "rank 1" in result.output and "Traceback" not in result.output


def test_help_and_models_print_only_diffpipe_lines(tmp_path: Path) -> None:
    """Issue 9.11: no library chatter (bitsandbytes, DeepSpeed, transformers) on the commands' output."""
    result = run_diffpipe(["--help"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("Usage:") and result.stderr == "", result.output
    assert "--verbose" in result.stdout and "--debug" in result.stdout
    result = run_diffpipe(["models"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0 and result.stderr == "", result.stderr
