"""``sequence_parallel`` (issue 44) on the tiny HunyuanVideo through the real CLI: 2 pipeline stages x 2 sequence ranks
(4 processes) with activation checkpointing on trains the losses and saves the LoRA of the same run in 1 process
without it, on clips of 192 tokens, and its ``[sample]`` video equals the 1-process run's. Joint attention splits
the video tokens over the sequence ranks and keeps the text tokens replicated (each rank takes its heads' share of
them), the joint mask stays the whole sequence's; each block's recomputation in backward repeats its all-to-alls;
the stages hand each other the local tokens; sampling runs the same split blocks without gradients."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpipe_core.testing import runs
from diffpipe_core.testing.media import write_clip_dataset, write_dataset_toml
from diffpipe_hunyuan.testing import TinyHunyuanConfig, write_tiny_hunyuan

pytestmark = pytest.mark.slow

STEPS = 3
PROMPT = "a red car moving"


def sample_latents(run: Path) -> torch.Tensor:
    """The final latents of the run's one sample, drawn after its last step."""
    return load_file(str(run / "samples" / f"step-{STEPS:07d}" / "latents.safetensors"))["sample_00"]


def test_two_stages_by_two_sequence_ranks_with_checkpointing_train_and_sample_as_one_process(tmp_path: Path) -> None:
    write_tiny_hunyuan(tmp_path / "model", TinyHunyuanConfig())
    write_clip_dataset(tmp_path / "media", 9, [PROMPT, "a river in a city"], (128, 128), fps=24)
    write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "media", resolutions=[128], enable_ar_bucket=False,
                       frame_buckets=[9])
    top = {"max_steps": STEPS, "seed": 3}
    model = {"type": "hunyuan-video"}
    sample = {"prompts": [PROMPT], "every_n_steps": STEPS, "steps": 2}  # the dataset's 128 px, 9 frames: 192 tokens
    (tmp_path / "one.toml").write_text(runs.lora_run_toml(model, 1e-2, sample=sample, **top))
    one = runs.train(tmp_path, "one.toml", 1, timeout=400, OMP_NUM_THREADS="1")
    # stage 0: the embedders and the 2 double-stream blocks; stage 1: the 2 single-stream blocks and the head
    (tmp_path / "sp.toml").write_text(runs.lora_run_toml(model, 1e-2, sample=sample, pipeline_stages=2,
                                                         partition_split=[3], sequence_parallel=2,
                                                         activation_checkpointing=True, **top))
    split, out = runs.train_with_output(tmp_path, "sp.toml", 4, timeout=400, OMP_NUM_THREADS="1")
    for stage in (0, 1):
        assert (f"stage {stage}: its blocks run on 1/2 of the tokens on each of 2 sequence ranks; 2 attention "
                "modules through DeepSpeed's Ulysses all-to-all") in out, out[-3000:]
    runs.assert_trained_in_stages(split, STEPS, 2)
    runs.assert_trains_as(split, one)
    torch.testing.assert_close(sample_latents(split), sample_latents(one), rtol=1e-4, atol=1e-5)
