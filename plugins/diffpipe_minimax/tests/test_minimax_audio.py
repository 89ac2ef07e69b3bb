"""Issue 40's audio-only LoRA of MiniMax H3 (``[model] train_audio = true, train_video = false``) on 2 pipeline
stages: the core's shared tone run (:func:`diffpipe_core.testing.runs.tone_run`: 4 clips with a tone track and 2
images without sound, float32) on 2 processes, the embedders and block 0 on stage 0, block 1 and the heads on stage 1,
so the audio rows of the packed sequence cross DeepSpeed's stage boundary forward and their gradient crosses it back.
The loss falls; the LoRA holds the block and refiner linears, no AdaLN projection and no embedder or head, and every
one of them trained (stage 0's only through the audio loss sent back across the boundary). The same project trained
again on 1 process (from the cache): its loss falls, and the 2-stage run logged its losses and saved its LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core import TrainingContext
from diffpipe_core.testing import runs
from diffpipe_minimax.plugin import BLOCK_LINEARS
from diffpipe_minimax.plugin import plugin as minimax

STEPS = 12
#: the run's ``[model]`` keys (the core's tone run adds ``train_audio`` and uniform times); 5-frame clips (2 latent
#: frames, 8 audio latents a channel at 24 fps)
MODEL = {"type": "minimax-h3", "text_max_length": 16, "train_video": False, "shift": 1.0}
TRAINED = {f"{block}.{linear}" for block in ("transformer_blocks.0", "transformer_blocks.1",
                                             "token_refiner.refiner_blocks.0") for linear in BLOCK_LINEARS}


def audio_run(root: Path) -> Path:
    """The shared audio-only run (conftest's ``minimax_audio_run``) in ``root``."""
    from diffpipe_minimax.testing import write_tiny_minimax

    return runs.tone_run(root, write_tiny_minimax, MODEL, procs=2, frames=5, frame_buckets=[1, 5], steps=STEPS,
                         pipeline_stages=2, partition_split=[2])


def test_audio_only_inputs_keep_the_video_out_of_the_loss(tiny_minimax: Path) -> None:
    """``train_video = false``: the video rows weigh nothing, the audio rows of the items with sound count; the LoRA
    targets are the joint run's (one stream of blocks: the audio rows go through the same linears as the video's)."""
    schema = minimax.spec.config_schema
    keys = {"type": "minimax-h3", "path": tiny_minimax, "dtype": "float32", "text_max_length": 12, "train_audio": True}
    audio_only, both = schema(**keys, train_video=False), schema(**keys)
    g = torch.Generator().manual_seed(3)
    batch = {"latents": torch.randn(2, 4, 2, 4, 4, generator=g), "audio_latents": torch.randn(2, 16, 8, generator=g),
             "audio_mask": torch.tensor([1.0, 0.0]), "text_embeds": torch.randn(2, 4, 32, generator=g),
             "text_mask": torch.ones(2, 4, dtype=torch.bool)}
    _, (_, _, video_weight, audio_weight) = minimax.prepare_inputs(
        batch, TrainingContext(model_config=audio_only), torch.Generator().manual_seed(4))
    assert video_weight.abs().sum() == 0
    assert audio_weight[0].min() == 1 and audio_weight[1].abs().sum() == 0
    assert minimax.lora_targets(audio_only) == minimax.lora_targets(both)


@pytest.mark.slow
def test_the_audio_only_lora_trains_on_two_stages_and_the_loss_falls(minimax_audio_run: Path) -> None:
    runs.assert_trained_in_stages(minimax_audio_run, STEPS, 2)
    runs.assert_loss_falls(minimax_audio_run, STEPS, window=3)
    state, _ = runs.read_saved_lora(minimax_audio_run / "saved" / "final", 4, 8.0)
    modules = {k.split(".lora_")[0].removeprefix("transformer.") for k in state}
    assert modules == TRAINED, sorted(modules ^ TRAINED)  # no adaln_proj, norm_out, proj_in / out, audio_proj_*
    params = runs.checkpoint_params(minimax_audio_run)
    untrained = [k for k in params if ".lora_B." in k and not params[k].abs().sum() > 0]
    assert not untrained, untrained  # stage 0's refiner and block 0 included: the gradient came back across


@pytest.mark.slow
def test_the_audio_only_lora_trains_on_one_stage_as_on_two(minimax_audio_run: Path) -> None:
    """The same project trained again from its cache on 1 process: the audio-only loss falls there too, and the
    2-stage run logged its losses and saved its LoRA (the audio rows crossed the boundary unchanged)."""
    runs.assert_trains_on_one_stage_as_on_several(minimax_audio_run, STEPS, 3)
