"""``sequence_parallel = 2`` (issue 44) on the tiny HunyuanVideo through the real CLI (2 processes): joint attention
splits the video tokens over the sequence ranks and keeps the text tokens replicated (each rank takes its heads'
share of them), the joint mask stays the whole sequence's; the run logs the losses and saves the LoRA of the same run
in 1 process, on clips of 192 tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing import runs
from diffpipe_core.testing.media import write_clip_dataset, write_dataset_toml
from diffpipe_hunyuan.testing import TinyHunyuanConfig, write_tiny_hunyuan

pytestmark = pytest.mark.slow

STEPS = 3


def test_two_sequence_ranks_train_as_one_process(tmp_path: Path) -> None:
    write_tiny_hunyuan(tmp_path / "model", TinyHunyuanConfig())
    write_clip_dataset(tmp_path / "media", 9, ["a red car moving", "a river in a city"], (128, 128), fps=24)
    write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "media", resolutions=[128], enable_ar_bucket=False,
                       frame_buckets=[9])
    top = {"max_steps": STEPS, "seed": 3}
    model = {"type": "hunyuan-video"}
    (tmp_path / "one.toml").write_text(runs.lora_run_toml(model, 1e-2, **top))
    one = runs.train(tmp_path, "one.toml", 1, timeout=400, OMP_NUM_THREADS="1")
    (tmp_path / "sp.toml").write_text(runs.lora_run_toml(model, 1e-2, sequence_parallel=2, **top))
    split, out = runs.train_with_output(tmp_path, "sp.toml", 2, timeout=400, OMP_NUM_THREADS="1")
    assert ("stage 0: its blocks run on 1/2 of the tokens on each of 2 sequence ranks; 4 attention modules through "
            "DeepSpeed's Ulysses all-to-all") in out, out[-3000:]  # 2 double-stream and 2 single-stream blocks
    runs.assert_trains_as(split, one)
