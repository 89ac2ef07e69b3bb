"""``sequence_parallel`` (issue 44) on the tiny Wan through the real CLI: 2 pipeline stages x 2 sequence ranks (4
processes: the tokens split over the sequence ranks, attention through DeepSpeed's Ulysses all-to-all, pipeline p2p
between the same sequence rank of adjacent stages) trains the losses and saves the LoRA of the same run in 1
process, on clips of 192 tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe_core.testing import runs
from diffpipe_core.testing.media import write_dataset_toml
from diffpipe_core.testing.processes import killed_and_resumed
from diffpipe_wan.testing import TinyWanConfig, write_clips, write_tiny_wan

pytestmark = pytest.mark.slow

STEPS = 4
CAPTIONS = ["a red car moving", "a river in a city"]


def test_two_stages_by_two_sequence_ranks_train_as_one_process(tmp_path: Path) -> None:
    write_tiny_wan(tmp_path / "model", TinyWanConfig())
    write_clips(tmp_path / "media", CAPTIONS, frames=9, size=(128, 128))  # latents 3 x 16 x 16: 192 tokens
    write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "media", resolutions=[128], enable_ar_bucket=False,
                       frame_buckets=[9])
    model = {"type": "wan", "text_max_length": 8}
    top = {"max_steps": STEPS, "seed": 3}
    (tmp_path / "one.toml").write_text(runs.lora_run_toml(model, 1e-2, **top))
    one = runs.train(tmp_path, "one.toml", 1, timeout=400, OMP_NUM_THREADS="1")
    (tmp_path / "sp.toml").write_text(runs.lora_run_toml(model, 1e-2, pipeline_stages=2, partition_split=[2],
                                                          sequence_parallel=2, checkpoint_every_n_steps=2, **top))
    # killed after step 3, resumed from its step-2 checkpoint: every step's loss is the 1-process run's
    split, out = killed_and_resumed(tmp_path, "sp.toml", 4, 3, timeout=400, OMP_NUM_THREADS="1")
    assert "resuming run" in out and "from step 2" in out, out[-3000:]
    for stage in (0, 1):  # one block a stage, its self-attention through the all-to-all
        assert (f"stage {stage}: its blocks run on 1/2 of the tokens on each of 2 sequence ranks; 1 attention "
                "modules through DeepSpeed's Ulysses all-to-all") in out, out[-3000:]
    runs.assert_trained_in_stages(split, STEPS, 2)
    runs.assert_trains_as(split, one)
