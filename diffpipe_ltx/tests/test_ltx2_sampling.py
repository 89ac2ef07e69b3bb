"""LTX-2 samples: the plugin's denoising hooks under the core's loop equal ``LTX2Pipeline`` for the same tiny model,
seed, prompt and steps (video and audio latents denoised together, as the pipeline does), the decoded video and sound
included;
with ``[model] sample_image`` they equal ``LTX2ImageToVideoPipeline`` from that image (its latents the clean first
latent frame), and a missing image is a config error naming the key; the shared run wrote its sample as an MP4 (with
the vocoder's sound)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from diffpipe_core.sampling.loop import noise_generator
from diffpipe_core.sampling.prompts import encode_prompts
from diffpipe_core.sampling.runner import decode
from diffpipe_core.schema import ConfigError, validate
from diffpipe_core.testing.media import write_png
from diffpipe_core.testing.sampling import assert_same_sample, registered, sample_latents
from diffpipe_core.types import SampleRequest
from diffpipe_ltx.config import LTX2Config
from diffpipe_ltx.ltx2 import FRAME_RATE
from diffpipe_ltx.ltx2 import ltx2 as ltx2_plugin
from diffpipe_ltx.ltx2_layers import split
from diffpipe_ltx.packing import unpack

PROMPT, STEPS, SEED, FRAMES, SIZE = "a red car", 3, 5, 9, 64
CPU = torch.device("cpu")


def test_ltx2_sample_equals_the_pipeline(tiny_ltx2: Path) -> None:
    from diffusers import LTX2Pipeline

    plugin = registered(ltx2_plugin)
    table = {"type": "ltx-2", "path": tiny_ltx2, "dtype": "float32", "encoder_dtype": "float32",
             "max_sequence_length": 16}
    cfg = validate(LTX2Config, table, "test")
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], None, CPU)
    request = SampleRequest(width=SIZE, height=SIZE, frames=FRAMES, steps=STEPS)
    ours = sample_latents(plugin, cfg, request, texts, SEED)

    pipe = LTX2Pipeline.from_pretrained(str(tiny_ltx2), local_files_only=True)
    call = dict(
        prompt=PROMPT, height=SIZE, width=SIZE, num_frames=FRAMES, frame_rate=FRAME_RATE, num_inference_steps=STEPS,
        guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_guidance_scale=1.0,
        audio_stg_scale=0.0, audio_modality_scale=1.0, audio_guidance_rescale=0.0,
        spatio_temporal_guidance_blocks=None, max_sequence_length=16,
    )
    video_latents, audio_latents = pipe(**call, generator=noise_generator(SEED, 0), output_type="latent",
                                        return_dict=False)
    f, h, w = 2, 2, 2
    video, audio = split(ours, f * h * w, 4, audio_latents.shape[2])
    vae = pipe.vae
    expected = LTX2Pipeline._normalize_latents(video_latents, vae.latents_mean, vae.latents_std,
                                               vae.config.scaling_factor)
    torch.testing.assert_close(unpack(video, f, h, w), expected, rtol=1e-4, atol=1e-4)
    packed = audio_latents.transpose(1, 2).flatten(2, 3)  # the pipeline denormalises the packed audio latents
    sound = LTX2Pipeline._normalize_audio_latents(packed, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
    torch.testing.assert_close(audio, sound, rtol=1e-4, atol=1e-4)

    ((_, pixels),) = decode(plugin, cfg, {0: ours}, CPU)
    out = pipe(**call, generator=noise_generator(SEED, 0), output_type="pt")
    frames = out.frames  # (1, F, 3, H, W) in [0, 1]
    assert pixels.shape == (3, FRAMES, SIZE, SIZE)
    torch.testing.assert_close((pixels + 1) / 2, frames[0].permute(1, 0, 2, 3), rtol=1e-3, atol=1e-3)
    # the sample's sound (muxed into its MP4) is the pipeline's waveform: audio VAE decoder, then vocoder
    wave, rate = ltx2_plugin.decode_audio(decoder=ltx2_plugin.load_decoder(model_config=cfg, device=CPU), latents=ours)
    assert rate == pipe.vocoder.config.output_sampling_rate and wave.shape == out.audio.shape
    torch.testing.assert_close(wave, out.audio.float().clamp(-1, 1), rtol=1e-3, atol=1e-4)


def test_ltx2_i2v_sample_equals_ltx2_image_to_video_pipeline(tiny_ltx2: Path, tmp_path: Path) -> None:
    from diffusers import LTX2ImageToVideoPipeline

    image_file = write_png(tmp_path / "first.png", 80, 72, seed=4)  # resized to 64x64 as the pipeline resizes
    plugin = registered(ltx2_plugin)
    table = {"type": "ltx-2", "path": tiny_ltx2, "dtype": "float32", "encoder_dtype": "float32",
             "max_sequence_length": 16, "sample_image": image_file}
    cfg = validate(LTX2Config, table, "test")
    (texts,) = encode_prompts(plugin, cfg, [PROMPT], None, CPU)
    request = SampleRequest(width=SIZE, height=SIZE, frames=FRAMES, steps=STEPS)
    ours = sample_latents(plugin, cfg, request, texts, SEED)

    pipe = LTX2ImageToVideoPipeline.from_pretrained(str(tiny_ltx2), local_files_only=True)
    video_latents, audio_latents = pipe(
        image=Image.open(image_file).convert("RGB"), prompt=PROMPT, height=SIZE, width=SIZE, num_frames=FRAMES,
        frame_rate=FRAME_RATE, num_inference_steps=STEPS, guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0,
        guidance_rescale=0.0, audio_guidance_scale=1.0, audio_stg_scale=0.0, audio_modality_scale=1.0,
        audio_guidance_rescale=0.0, spatio_temporal_guidance_blocks=None, max_sequence_length=16,
        generator=noise_generator(SEED, 0), output_type="latent", return_dict=False,
    )
    video = assert_pipeline_sample(ours, pipe, video_latents, audio_latents)
    # the first latent frame stayed the image's latents, as the pipeline encodes it (no scaling factor)
    torch.testing.assert_close(video[:, :, :1], ltx2_plugin.sample_condition(cfg, request)["latents"])


def assert_pipeline_sample(ours: torch.Tensor, pipe, video_latents: torch.Tensor, audio_latents: torch.Tensor,
                           grid: tuple[int, int, int] = (2, 2, 2)) -> torch.Tensor:
    """diffpipe's sample ``ours`` (packed video and audio side by side) equals an LTX-2 pipeline's ``output_type =
    "latent"`` result, which the pipeline denormalised (normalised back with its VAEs' statistics), and moved away
    from the noise of ``SEED``; returns our video latents unpacked."""
    f, h, w = grid
    video, audio = split(ours, f * h * w, video_latents.shape[1], audio_latents.shape[2])
    vae = pipe.vae
    expected = pipe._normalize_latents(video_latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    noise = torch.randn((1, video_latents.shape[1], f, h, w), generator=noise_generator(SEED, 0))
    assert_same_sample(unpack(video, f, h, w), expected, noise)
    packed = audio_latents.transpose(1, 2).flatten(2, 3)
    sound = pipe._normalize_audio_latents(packed, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
    torch.testing.assert_close(audio, sound, rtol=1e-4, atol=1e-4)
    return unpack(video, f, h, w)


def test_a_missing_sample_image_is_a_config_error_naming_it(tiny_ltx2: Path, tmp_path: Path) -> None:
    from diffpipe_core.config import load_config
    from diffpipe_core.registry import get_registry
    from diffpipe_core.testing import runs

    model = {"type": "ltx-2", "path": str(tiny_ltx2), "max_sequence_length": 16, "sample_image": "nope.png"}
    (tmp_path / "run.toml").write_text(runs.run_toml(model, {"lr": 1e-4}))
    with pytest.raises(ConfigError) as raised:
        load_config(tmp_path / "run.toml", get_registry(), purpose="sample")
    assert f"model.sample_image: path not found: {tmp_path / 'nope.png'}" in "\n".join(raised.value.problems)


def test_the_shared_run_wrote_an_mp4_sample(ltx2_run: Path) -> None:
    import av

    files = sorted((ltx2_run / "samples").rglob("*.mp4"))
    assert len(files) == 1, files
    with av.open(str(files[0])) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        assert container.streams.audio[0].rate == 16000  # the vocoder's sound (the LoRA left the audio branch frozen)
    assert len(frames) == 9 and frames[0].shape == (64, 64, 3)
