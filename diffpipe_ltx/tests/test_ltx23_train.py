"""The shared LTX-2.3 run (issue 40): ``diffpipe train --model ltx-2.3`` on 1 process, both streams trained
(``train_audio = true``: the video and audio LoRA, the clips' sound in the loss) on 4 tone clips and 2 images without
sound, from the tiny LTX-2.3 folder. The loss falls; the LoRA holds both streams' modules; loaded by
``LTX2Pipeline.load_lora_weights`` it reproduces the trained transformer's video and audio predictions; its ComfyUI file
has the keys ComfyUI's key map accepts and applies as the diffusers LoRA merged; the sample is an MP4 with sound."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_ltx2_train import assert_comfyui_file

from diffpipe_core.testing import runs
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_ltx.ltx2 import AUDIO_LORA_TARGETS
from diffpipe_ltx.ltx2_testing import write_clips, write_tiny_ltx23

pytestmark = pytest.mark.slow

RANK, ALPHA, STEPS = 4, 8.0, 12
SAMPLE = {"prompts": ["a bell"], "every_n_steps": STEPS, "steps": 2, "seed": 5, "resolution": 64, "frames": 9}


@pytest.fixture(scope="module")
def ltx23_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ltx23_run")
    write_tiny_ltx23(root / "model")
    data = root / "data"
    write_clips(data, ["a bell", "a bell ringing", "a tone", "a high tone"], frames=12, size=(64, 64), audio="tone")
    write_image_dataset(data, 2, size=(64, 64), captions=["a cat", "a dog"])
    write_dataset_toml(root / "dataset.toml", data, resolutions=[64], enable_ar_bucket=False, frame_buckets=[1, 9])
    model = {"type": "ltx-2.3", "max_sequence_length": 16, "timestep_sample_method": "uniform", "train_audio": True}
    top = {"output_dir": "out", "max_steps": STEPS, "gradient_accumulation_steps": 2, "seed": 3,
           "checkpoint_every_n_steps": STEPS}
    (root / "run.toml").write_text(runs.lora_run_toml(model, 2e-2, SAMPLE, RANK, ALPHA, **top))
    return runs.train(root, "run.toml", procs=1, timeout=500)


def transformer_inputs() -> dict:
    """One call of the tiny LTX-2.3 transformer: each stream's text at its own width (32 video, 16 audio)."""
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(1, 8, 4, generator=g), "audio_hidden_states": torch.randn(1, 9, 4, generator=g),
        "encoder_hidden_states": torch.randn(1, 16, 32, generator=g),
        "audio_encoder_hidden_states": torch.randn(1, 16, 16, generator=g),
        "timestep": torch.tensor([400.0]), "sigma": torch.tensor([400.0]), "encoder_attention_mask": torch.ones(1, 16),
        "audio_encoder_attention_mask": torch.ones(1, 16), "num_frames": 2, "height": 2, "width": 2, "fps": 24.0,
        "audio_num_frames": 9, "use_cross_timestep": True,
    }


def outputs(model) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return model(**transformer_inputs(), return_dict=False)


def test_ltx23_trains_video_and_audio_and_the_loss_falls(ltx23_run: Path) -> None:
    import av

    runs.assert_loss_falls(ltx23_run, STEPS, STEPS // 4)
    (mp4,) = sorted((ltx23_run / "samples").rglob("*.mp4"))
    with av.open(str(mp4)) as container:
        assert container.streams.audio[0].rate == 16000 and len(container.streams.video) == 1


def test_the_ltx23_lora_loads_in_ltx2_pipeline_and_reproduces_both_streams(ltx23_run: Path) -> None:
    from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel

    saved, model_dir = ltx23_run / "saved" / "final", ltx23_run.parent.parent / "model"
    state, cfg = runs.read_saved_lora(saved, RANK, ALPHA)
    for key in ("transformer_blocks.0.attn1.to_q", "transformer_blocks.1.ff.net.2",
                "transformer_blocks.0.audio_attn2.to_k", "transformer_blocks.1.video_to_audio_attn.to_v"):
        assert f"transformer.{key}.lora_A.weight" in state, key
    assert not any("to_gate_logits" in k for k in state)  # off by default, as the anchor leaves it
    trained = ("transformer_blocks.1.audio_ff.net.2.lora_A.default.weight",
               "transformer_blocks.1.attn2.to_k.lora_A.default.weight")
    reference = runs.trained_transformer(LTX2VideoTransformer3DModel, ltx23_run, model_dir, RANK, ALPHA,
                                         cfg["target_modules"], trained)
    pipe = LTX2Pipeline.from_pretrained(str(model_dir), local_files_only=True)
    untrained_video, untrained_audio = outputs(pipe.transformer)
    runs.load_lora_into(pipe, saved / "adapter_model.safetensors")
    video, audio = outputs(pipe.transformer)
    expected_video, expected_audio = outputs(reference)
    runs.assert_reproduces(video, expected_video, untrained_video)
    runs.assert_reproduces(audio, expected_audio, untrained_audio)


def test_the_ltx23_comfyui_file_has_the_keys_comfyui_maps_and_applies_like_diffusers(ltx23_run: Path) -> None:
    modules = assert_comfyui_file(ltx23_run, RANK)
    video = {f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")} | {
        "ff.net.0.proj", "ff.net.2"}
    assert modules == {f"transformer_blocks.{i}.{t}" for i in range(2) for t in (*video, *AUDIO_LORA_TARGETS)}
