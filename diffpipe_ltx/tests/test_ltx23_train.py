"""The shared LTX-2.3 run (issue 40): ``diffpipe train --model ltx-2.3`` on 1 process, both streams trained
(``train_audio = true``: the video and audio LoRA, the clips' sound in the loss) on 4 tone clips and 2 images without
sound, from the tiny LTX-2.3 folder. The loss falls; the LoRA holds both streams' modules; loaded by
``LTX2Pipeline.load_lora_weights`` it reproduces the trained transformer's video and audio predictions; its ComfyUI file
has the keys ComfyUI's key map accepts and applies as the diffusers LoRA merged; the sample is an MP4 with sound."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_ltx2_audio import STEPS, tone_run
from test_ltx2_train import assert_comfyui_file, lora_outputs, transformer_inputs

from diffpipe_core.testing import runs
from diffpipe_ltx.ltx2 import AUDIO_LORA_TARGETS
from diffpipe_ltx.ltx2_testing import write_tiny_ltx23

pytestmark = pytest.mark.slow

RANK, ALPHA = 4, 8.0  # tone_run's


@pytest.fixture(scope="module")
def ltx23_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tone_run(tmp_path_factory.mktemp("ltx23_run"), write_tiny_ltx23, {"type": "ltx-2.3"}, procs=1)


def test_ltx23_trains_video_and_audio_and_the_loss_falls(ltx23_run: Path) -> None:
    import av

    runs.assert_loss_falls(ltx23_run, STEPS, STEPS // 4)
    (mp4,) = sorted((ltx23_run / "samples").rglob("*.mp4"))
    with av.open(str(mp4)) as container:
        assert container.streams.audio[0].rate == 16000 and len(container.streams.video) == 1


def test_the_ltx23_lora_loads_in_ltx2_pipeline_and_reproduces_both_streams(ltx23_run: Path) -> None:
    trained = ("transformer_blocks.1.audio_ff.net.2.lora_A.default.weight",
               "transformer_blocks.1.attn2.to_k.lora_A.default.weight")
    (untrained_video, untrained_audio), (video, audio), (expected_video, expected_audio), state = lora_outputs(
        ltx23_run, RANK, ALPHA, trained, transformer_inputs(32, 16))  # each stream's text width
    for key in ("transformer_blocks.0.attn1.to_q", "transformer_blocks.1.ff.net.2",
                "transformer_blocks.0.audio_attn2.to_k", "transformer_blocks.1.video_to_audio_attn.to_v"):
        assert f"transformer.{key}.lora_A.weight" in state, key
    assert not any("to_gate_logits" in k for k in state)  # off by default, as the anchor leaves it
    runs.assert_reproduces(video, expected_video, untrained_video)
    runs.assert_reproduces(audio, expected_audio, untrained_audio)


def test_the_ltx23_comfyui_file_has_the_keys_comfyui_maps_and_applies_like_diffusers(ltx23_run: Path) -> None:
    modules = assert_comfyui_file(ltx23_run, RANK)
    video = {f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")} | {
        "ff.net.0.proj", "ff.net.2"}
    assert modules == {f"transformer_blocks.{i}.{t}" for i in range(2) for t in (*video, *AUDIO_LORA_TARGETS)}
