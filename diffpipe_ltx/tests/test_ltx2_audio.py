"""LTX-2 audio (issue 40, ``[model] train_audio`` / ``train_video``): the clips' sound cached as the audio VAE's
latents (packed and normalised as ``LTX2Pipeline`` packs and normalises audio latents; the log-mel front-end checked
against transformers' own spectrogram code), the joint flow-matching inputs and weights, the LoRA targets of each
stream, the audio crossing a stage boundary (LTX-2 and LTX-2.3 layers, in-process), and one shared tiny run of an
audio-only LoRA on tone clips on 2 pipeline stages (2 processes): its loss falls, only the audio stream's modules
trained, its samples are MP4s with a sound track, and the LoRA loaded by ``LTX2Pipeline.load_lora_weights``
reproduces the trained transformer's audio (and video) prediction; its ComfyUI file has the keys ComfyUI's key map
accepts for the native ``LTXAVModel`` and applies as the diffusers LoRA merged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_ltx2_matches_pipeline import config
from test_ltx2_train import assert_comfyui_file, lora_outputs

from diffpipe_core import AudioSpec, EncodeBatch, TrainingContext
from diffpipe_core.schema import ConfigError, validate
from diffpipe_core.testing import runs
from diffpipe_core.testing.media import tone
from diffpipe_ltx.ltx2 import AUDIO_LORA_TARGETS, FRAME_RATE
from diffpipe_ltx.ltx2 import ltx2 as plugin
from diffpipe_ltx.ltx2_audio import N_FFT
from diffpipe_ltx.ltx2_testing import write_tiny_ltx2

CPU = torch.device("cpu")
RATE, HOP = 16000, 160  # the tiny audio VAE's sample_rate and mel_hop_length (LTX-2's)


def reference_mel(wave: torch.Tensor, mel_bins: int) -> torch.Tensor:
    """The log-mel spectrogram ``(1, C, T, mel_bins)`` by transformers' numpy ``spectrogram`` (its own framing, window
    and FFT), with the same settings as the original LTX-2 audio processor."""
    from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

    bank = mel_filter_bank(num_frequency_bins=N_FFT // 2 + 1, num_mel_filters=mel_bins, min_frequency=0.0,
                           max_frequency=RATE / 2, sampling_rate=RATE, norm="slaney", mel_scale="slaney")
    planes = [spectrogram(channel.numpy().astype(np.float64), window_function(N_FFT, "hann"), frame_length=N_FFT,
                          hop_length=HOP, fft_length=N_FFT, power=1.0, center=True, pad_mode="reflect",
                          mel_filters=bank, mel_floor=1e-5, log_mel="log") for channel in wave[0]]
    return torch.from_numpy(np.stack(planes)).float().transpose(1, 2)[None]


def test_audio_latents_are_the_audio_vaes_encoding_as_the_pipeline_packs_it(tiny_ltx2: Path) -> None:
    from diffusers import AutoencoderKLLTX2Audio, LTX2Pipeline

    cfg = config(tiny_ltx2, train_audio=True)
    assert plugin.audio_spec(model_config=cfg) == AudioSpec(RATE, 2)
    assert plugin.audio_spec(model_config=config(tiny_ltx2)) is None  # video-only: no audio is read
    encoders = plugin.load_encoders(model_config=cfg, device=CPU)
    frames = 9
    sound = torch.from_numpy(tone(frames / FRAME_RATE, 440.0, RATE))
    wave = torch.stack([torch.stack([sound, 0.5 * sound]), torch.zeros(2, len(sound))])
    pixels = torch.rand(2, 3, frames, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    out = plugin.encode_batch(encoders=encoders, batch=EncodeBatch(
        pixels=pixels, audio=wave, audio_present=torch.tensor([True, False])))

    vae = AutoencoderKLLTX2Audio.from_pretrained(tiny_ltx2 / "audio_vae").eval()
    length = round(frames / FRAME_RATE * RATE / HOP / 4)  # LTX2Pipeline's audio_num_frames for 9 frames
    with torch.no_grad():
        z = vae.encode(reference_mel(wave[:1], vae.config.mel_bins)).latent_dist.mode()
    expected = LTX2Pipeline._normalize_audio_latents(LTX2Pipeline._pack_audio_latents(z[:, :, :length]),
                                                     vae.latents_mean, vae.latents_std)
    assert out["audio_latents"].shape == (2, length, vae.config.latent_channels * vae.config.mel_bins // 4)
    torch.testing.assert_close(out["audio_latents"][:1], expected, atol=2e-4, rtol=1e-4)
    assert out["audio_mask"].tolist() == [1.0, 0.0]


def _batch(tiny_ltx2: Path, cfg, audio: bool, widths: tuple[int, int] = (16, 16)) -> dict:
    g = torch.Generator().manual_seed(1)
    batch = {"latents": torch.randn(2, 4, 2, 2, 2, generator=g),
             "video_text": torch.randn(2, 16, widths[0], generator=g),
             "audio_text": torch.randn(2, 16, widths[1], generator=g), "text_mask": torch.ones(2, 16, dtype=torch.bool)}
    if audio:
        batch["audio_latents"] = torch.randn(2, 9, 4, generator=g)
        batch["audio_mask"] = torch.tensor([1.0, 0.0])
    return batch


def test_the_joint_flow_inputs_and_weights_of_each_stream(tiny_ltx2: Path) -> None:
    from diffpipe_ltx.ltx2_layers import split

    both = config(tiny_ltx2, train_audio=True)
    batch = _batch(tiny_ltx2, both, audio=True)
    (x, t, audio, *_), (target, weight) = plugin.prepare_inputs(
        batch=batch, context=TrainingContext(model_config=both), generator=torch.Generator().manual_seed(2))
    # the same draws without sound: the audio input is the step's noise alone (the pipeline's), outside the loss
    (_, _, noise, *_), (_, silent_weight) = plugin.prepare_inputs(
        batch=_batch(tiny_ltx2, both, audio=False), context=TrainingContext(model_config=both),
        generator=torch.Generator().manual_seed(2))
    ta = t[:, -1].view(2, 1, 1)  # the audio stream's time is the sample's
    clean = batch["audio_latents"]
    torch.testing.assert_close(audio, (1 - ta) * clean + ta * noise)
    video_target, audio_target = split(target, 8, 4, 9)
    video_weight, audio_weight = split(weight, 8, 4, 9)
    torch.testing.assert_close(audio_target, noise - clean)
    assert audio_weight[1].abs().sum() == 0 and (audio_weight[0] > 0).all()  # the item without sound weighs 0
    assert split(silent_weight, 8, 4, 9)[1].abs().sum() == 0
    # the loss as Lightricks' LTX-2 trainer computes it (ltx_trainer text_to_video compute_loss): per item the video
    # stream's mean squared error plus the audio stream's, averaged over the items (here: the item without sound
    # has its video part only); the old (pooled video mean + audio mean) / 2 gives another value
    pred = target + torch.randn(target.shape, generator=torch.Generator().manual_seed(3)) * torch.linspace(
        0.5, 2.0, target.shape[1])
    err_video, err_audio = split((pred - target) ** 2, 8, 4, 9)
    expected = (err_video[0].mean() + err_audio[0].mean() + err_video[1].mean()) / 2
    context = TrainingContext(model_config=both)
    torch.testing.assert_close(plugin.compute_loss(outputs=(pred,), targets=(target, weight), context=context),
                               expected)
    old = (err_video.mean() + err_audio[0].mean()) / 2
    assert not torch.isclose(expected, old, rtol=1e-3)

    audio_only = config(tiny_ltx2, train_audio=True, train_video=False)
    _, (_, weight) = plugin.prepare_inputs(batch=batch, context=TrainingContext(model_config=audio_only),
                                           generator=torch.Generator().manual_seed(2))
    assert split(weight, 8, 4, 9)[0].abs().sum() == 0 and split(weight, 8, 4, 9)[1].abs().sum() > 0
    loss = plugin.compute_loss(outputs=(pred,), targets=(target, weight),
                               context=TrainingContext(model_config=audio_only))
    torch.testing.assert_close(loss, err_audio[0].mean())  # the silent item has nothing in the loss: not counted

    # LoRA targets of each stream
    assert plugin.lora_targets(model_config=audio_only) == list(AUDIO_LORA_TARGETS)
    assert "attn1.to_q" in plugin.lora_targets(model_config=both) and "audio_ff.net.2" in plugin.lora_targets(
        model_config=both)
    assert not set(AUDIO_LORA_TARGETS) & set(plugin.lora_targets(model_config=config(tiny_ltx2)))
    with pytest.raises(ConfigError, match="leave nothing to train"):
        config(tiny_ltx2, train_video=False)


@pytest.mark.parametrize("name", ["ltx-2", "ltx-2.3"])
def test_the_audio_crosses_a_stage_boundary_as_the_forward_with_audio(name: str, request) -> None:
    """Two stages loaded each with only its own layers' weights (as 2 ranks load them), chained in-process through
    the tensors a pipeline boundary passes (detached copies): the audio stream crosses it (with LTX-2.3's prompt
    modulation), and the output equals ``LTX2VideoTransformer3DModel``'s forward on the same noisy video and audio
    latents."""
    from diffusers import LTX2VideoTransformer3DModel

    from diffpipe_core.engine import model_loading
    from diffpipe_core.engine.partition import stage_parts
    from diffpipe_core.registry import Registry
    from diffpipe_ltx.ltx2_layers import split
    from diffpipe_ltx.ltx23 import ltx23

    model, folder = (plugin, request.getfixturevalue("tiny_ltx2")) if name == "ltx-2" else (
        ltx23, request.getfixturevalue("tiny_ltx23"))
    registry = Registry()
    assert registry.register_model(name, model).ok
    registered = registry.model(name)
    table = {"type": name, "path": folder, "dtype": "float32", "encoder_dtype": "float32", "max_sequence_length": 16,
             "train_audio": True}
    cfg = validate(model.spec.config_schema, table, "test")
    widths = (16, 16) if name == "ltx-2" else (32, 16)  # LTX-2.3's text has each stream's width
    inputs, _ = model.prepare_inputs(batch=_batch(folder, cfg, audio=True, widths=widths), context=TrainingContext(
        model_config=cfg), generator=torch.Generator().manual_seed(2))
    stages = [model_loading.load_for_stages(registered, cfg, CPU, torch.float32) for _ in range(2)]
    parts = stage_parts(stages[0].layers, 2)
    x = inputs
    with torch.no_grad():
        for i, stage in enumerate(stages):
            own = range(parts[i], parts[i + 1])
            model_loading.materialise_layers(registered, cfg, stage, own, CPU)
            if i:  # what crosses the boundary: the audio stream among the tensors
                assert any(t.shape[:2] == (2, 9) and t.is_floating_point() for t in x)
                x = tuple(t.detach().clone() for t in x)
            for k in own:
                x = stage.layers[k](x)
        video, audio = split(x[0], 8, 4, 9)
        transformer = LTX2VideoTransformer3DModel.from_pretrained(str(folder / "transformer")).eval()
        timestep = inputs[1][:, -1] * 1000
        expected_video, expected_audio = transformer(
            hidden_states=inputs[0], audio_hidden_states=inputs[2], encoder_hidden_states=inputs[3],
            audio_encoder_hidden_states=inputs[4], timestep=timestep, sigma=timestep,
            encoder_attention_mask=inputs[5].float(), audio_encoder_attention_mask=inputs[5].float(), num_frames=2,
            height=2, width=2, fps=float(FRAME_RATE), audio_num_frames=9, use_cross_timestep=True, return_dict=False)
    torch.testing.assert_close(audio, expected_audio, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(video, expected_video, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------- the shared audio run
STEPS = 12
SAMPLE = {"prompts": ["a bell"], "every_n_steps": STEPS, "steps": 2, "seed": 5, "resolution": 64, "frames": 9}


@pytest.fixture(scope="module")
def audio_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An audio-only LoRA (``train_video = false``) on 4 tone clips and 2 images (no sound), on 2 pipeline stages
    (2 processes; embedders + block 0 | block 1 + output): the audio stream crosses DeepSpeed's stage boundary. Its
    1-process twin is trained from its cache by the test below; the 1-process run with both streams in the loss is
    the shared LTX-2.3 run (``test_ltx23_train.py``)."""
    root = tmp_path_factory.mktemp("ltx2_audio")
    model = {"type": "ltx-2", "train_video": False}
    return tone_run(root, write_tiny_ltx2, model, procs=2, pipeline_stages=2, partition_split=[2])


def tone_run(root: Path, write_model, model: dict, procs: int, **top) -> Path:
    """The core's shared audio run (:func:`diffpipe_core.testing.runs.tone_run`) of a tiny LTX-2 model: 12-frame
    tone clips in the 9-frame bucket, 16 text tokens, a 9-frame sample at the end."""
    return runs.tone_run(root, write_model, {"max_sequence_length": 16, **model}, procs, frames=12,
                         frame_buckets=[1, 9], steps=STEPS, sample=SAMPLE, fps=FRAME_RATE, **top)


@pytest.mark.slow
def test_an_audio_only_lora_learns_the_tone_and_samples_have_sound(audio_run: Path) -> None:
    import av
    from safetensors.torch import load_file

    runs.assert_trained_in_stages(audio_run, STEPS, 2)
    runs.assert_loss_falls(audio_run, STEPS, STEPS // 4)
    lora = load_file(str(audio_run / "saved" / "final" / "adapter_model.safetensors"))
    modules = {k.split(".lora_")[0] for k in lora}
    assert modules and all(any(m.endswith(t) for t in AUDIO_LORA_TARGETS) for m in modules), sorted(modules)[:4]
    (mp4,) = sorted((audio_run / "samples").rglob("*.mp4"))
    with av.open(str(mp4)) as container:
        stream = container.streams.audio[0]
        assert stream.rate == RATE and stream.codec_context.channels == 2
        samples = sum(f.samples for f in container.decode(stream))
    # as long as the vocoder's waveform of the sample's 9 audio latent frames (the tiny vocoder upsamples 4x, not the
    # released 160x), within one AAC frame
    from diffpipe_ltx.ltx2_audio import decode_audio

    parts = plugin.load_decoder(model_config=config(audio_run.parent.parent / "model"), device=CPU).diffpipe_audio
    wave = decode_audio(parts["audio_vae"], parts["vocoder"], torch.zeros(1, 9, 4), parts.latent_mel)
    assert wave.shape[:2] == (1, 2) and 0 < samples - wave.shape[2] <= 1024, (samples, wave.shape)


@pytest.mark.slow
def test_the_audio_only_lora_trains_on_one_stage_as_on_two(audio_run: Path) -> None:
    """The same project trained again from its cache on 1 process (no sample): the audio-only loss falls there too,
    and the 2-stage run logged its losses and saved its LoRA (the audio stream crossed the boundary unchanged)."""
    runs.assert_trains_on_one_stage_as_on_several(audio_run, STEPS, STEPS // 4)


@pytest.mark.slow
def test_the_audio_lora_loads_in_ltx2_pipeline_and_reproduces_the_trained_audio(audio_run: Path) -> None:
    trained = ("transformer_blocks.1.audio_ff.net.2.lora_A.default.weight",)
    (_, untrained_audio), (video, audio), (expected_video, expected_audio), state = lora_outputs(
        audio_run, 4, 8.0, trained)
    assert "transformer.transformer_blocks.0.audio_attn1.to_q.lora_A.weight" in state
    assert "transformer.transformer_blocks.1.video_to_audio_attn.to_v.lora_B.weight" in state
    runs.assert_reproduces(audio, expected_audio, untrained_audio)
    torch.testing.assert_close(video, expected_video, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_audio_loras_comfyui_file_has_the_keys_comfyui_maps_and_applies_like_diffusers(audio_run: Path) -> None:
    modules = assert_comfyui_file(audio_run, 4)
    # every audio-stream module of both blocks, under its native LTXAVModel name (comfy/ldm/lightricks/av_model.py)
    assert modules == {f"transformer_blocks.{i}.{t}" for i in range(2) for t in AUDIO_LORA_TARGETS}


@pytest.mark.slow
def test_an_ltx23_audio_only_lora_trains_on_two_stages_as_on_one(tmp_path: Path) -> None:
    """LTX-2.3 (prompt adaLN tensors and per-stream text widths crossing the boundary beside the audio stream): the
    audio-only LoRA on 2 pipeline stages trains only audio-stream modules, every stage's share, and its 1-process twin
    from the same cache falls and logged the same losses and saved the same LoRA."""
    from safetensors.torch import load_file

    from diffpipe_ltx.ltx2_testing import write_tiny_ltx23

    model = {"type": "ltx-2.3", "train_video": False, "max_sequence_length": 16}
    run = runs.tone_run(tmp_path, write_tiny_ltx23, model, procs=2, frames=12, frame_buckets=[1, 9], steps=STEPS,
                        fps=FRAME_RATE, pipeline_stages=2, partition_split=[2])
    runs.assert_trained_in_stages(run, STEPS, 2)
    lora = load_file(str(run / "saved" / "final" / "adapter_model.safetensors"))
    modules = {k.split(".lora_")[0] for k in lora}
    assert modules and all(any(m.endswith(t) for t in AUDIO_LORA_TARGETS) for m in modules), sorted(modules)[:4]
    runs.assert_trains_on_one_stage_as_on_several(run, STEPS, STEPS // 4)
