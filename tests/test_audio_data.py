"""Issue 40, the core's audio data path: each video's audio track decoded at the model's rate over exactly the span
of the frames taken, silent / missing / damaged tracks, images and mixed datasets, the waveform in ``encode_batch``
and what it returns cached with the clip (content-keyed), and ``diffpipe data``'s per-bucket count of items with sound.

Clips with a sine-tone AAC track come from :func:`diffpipe_core.testing.media.write_video`; the expected sound is
the same sine computed here (AAC is lossy: compared by correlation and error bound, not bit for bit).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

import diffpipe_reference.plugin as reference
from diffpipe_core import AudioSpec, hookimpl
from diffpipe_core.data import prepare_cache
from diffpipe_core.data.cache_keys import media_key
from diffpipe_core.data.dataset_config import load_dataset_config
from diffpipe_core.data.decode import MediaError, load_media
from diffpipe_core.data.items import Bucket, MediaItem
from diffpipe_core.data.report import format_report
from diffpipe_core.data.scan import scan_dataset
from diffpipe_core.registry import Registry
from diffpipe_core.testing.cache import rows_by_id
from diffpipe_core.testing.media import tone as sine
from diffpipe_core.testing.media import write_png, write_video
from diffpipe_core.testing.specs import TINY_VIDEO_SPEC
from diffpipe_core.types import EncodeBatch
from diffpipe_reference.model import write_tiny_model

NATIVE = dataclasses.replace(TINY_VIDEO_SPEC, video_fps=None)  # frames at the file's own rate (16 fps here)
RATE = 8000


def clip_item(path: Path, frames: int, start: float | None = None) -> MediaItem:
    return MediaItem(id=path.name, path=path, caption="", bucket=Bucket(32, 32, frames), content_key="k",
                     clip_start=start)


def assert_tone(wave: torch.Tensor, hz: float, start: float, edge: int = RATE // 10) -> None:
    """``wave`` (C, S) is the sine of ``hz`` from ``start`` seconds (every channel), away from AAC's first frame."""
    ref = sine(wave.shape[1] / RATE, hz, RATE, start)
    for channel in wave.numpy():
        inner, expected = channel[edge:-edge], ref[edge:-edge]
        assert np.corrcoef(inner, expected)[0, 1] > 0.99
        assert np.abs(inner - expected).max() < 0.06


def test_the_tone_is_decoded_at_the_models_rate_over_the_span_of_the_frames_taken(tmp_path: Path) -> None:
    clip = write_video(tmp_path / "tone.mp4", 48, fps=16, size=(32, 32), audio="tone", tone_hz=440.0)
    mono = AudioSpec(RATE)
    # 17 frames at the native 16 fps from 1.0 s: 17/16 s of sound from 1.0 s (a clip mode's later clip)
    out = load_media(clip_item(clip, 17, start=1.0), NATIVE, mono)
    assert out.pixels.shape == (3, 17, 32, 32) and out.audio.shape == (1, round(17 / 16 * RATE))
    assert out.audio_present and out.audio_note is None
    assert_tone(out.audio, 440.0, 1.0)
    # from the start: the same sine from 0 (a wrong offset would show as a phase shift: 1 ms is 0.44 of a cycle)
    assert_tone(load_media(clip_item(clip, 17), NATIVE, mono).audio, 440.0, 0.0)
    # the model's frame rate decides the span: 9 frames resampled to 8 fps are 9/8 s
    at_8 = load_media(clip_item(clip, 9, start=0.5), TINY_VIDEO_SPEC, AudioSpec(RATE, channels=2))
    assert at_8.audio.shape == (2, round(9 / 8 * RATE))
    assert_tone(at_8.audio, 440.0, 0.5)
    # another frequency is another sound: the comparison above can fail
    with pytest.raises(AssertionError):
        assert_tone(out.audio, 880.0, 1.0)
    # a model without audio gets none
    assert load_media(clip_item(clip, 17), NATIVE).audio is None


def test_silent_missing_and_image_items_and_a_damaged_stream(tmp_path: Path) -> None:
    spec, mono = NATIVE, AudioSpec(RATE)
    silent = load_media(clip_item(write_video(tmp_path / "silent.mp4", 20, 16, (32, 32), audio="silent"), 17),
                        spec, mono)
    assert silent.audio_present and silent.audio.abs().max() < 1e-3  # a track of silence is sound
    none = load_media(clip_item(write_video(tmp_path / "none.mp4", 20, 16, (32, 32)), 17), spec, mono)
    assert not none.audio_present and none.audio_note is None and torch.equal(none.audio, torch.zeros(1, 8500))
    image = write_png(tmp_path / "still.png", 32, 32)
    still = load_media(MediaItem(id="still.png", path=image, caption="", bucket=Bucket(32, 32), content_key="k"),
                       TINY_VIDEO_SPEC, mono)
    assert not still.audio_present and still.audio.shape == (1, RATE // 8)  # one frame's span at 8 fps

    damaged = write_video(tmp_path / "damaged.mp4", 20, 16, (32, 32), audio="damaged")
    out = load_media(clip_item(damaged, 17), spec, mono)  # the default: trains without audio, the stream named
    assert not out.audio_present and out.pixels.shape == (3, 17, 32, 32)
    assert out.audio_note.startswith(f"{damaged}: audio stream #1 (aac) cannot be decoded")
    assert out.audio_note.endswith("trains without audio")
    with pytest.raises(MediaError, match=r"damaged\.mp4: damaged audio, left out .*audio stream #1 \(aac\)"):
        load_media(clip_item(damaged, 17), spec, AudioSpec(RATE, damaged="skip"))


class AudioModel:
    """The reference model as a video model with sound: ``encode_batch`` adds a stand-in audio encoder's output
    (the waveform average-pooled to 16 values) and the item's ``audio_mask``."""

    spec = dataclasses.replace(TINY_VIDEO_SPEC, name="reference-audio", config_schema=reference.ReferenceConfig,
                               encoder_settings=("path",))

    def __init__(self, audio: AudioSpec) -> None:
        self.audio, self.batches = audio, []

    @hookimpl
    def model_spec(self):
        return self.spec

    @hookimpl
    def audio_spec(self, model_config):
        return self.audio

    @hookimpl
    def load_encoders(self, model_config, device):
        return reference.load_encoders(model_config, device)

    @hookimpl
    def encode_batch(self, encoders, batch: EncodeBatch):
        import torch.nn.functional as F

        self.batches.append(batch)
        if batch.captions is not None:
            return {"text_embeds": encoders[1](batch.captions)}
        frames = batch.pixels if batch.pixels.ndim == 5 else batch.pixels[:, :, None]
        return {"latents": F.adaptive_avg_pool3d(frames, (frames.shape[2], 4, 4)),
                "audio_latents": F.adaptive_avg_pool1d(batch.audio, 16),
                "audio_mask": batch.audio_present.float()}


def _dataset(root: Path) -> Path:
    clips = root / "clips"
    write_video(clips / "tone.mp4", 12, 8, (32, 32), seed=1, audio="tone")
    write_video(clips / "quiet.mp4", 12, 8, (32, 32), seed=2)  # no track
    write_video(clips / "damaged.mp4", 12, 8, (32, 32), seed=3, audio="damaged")
    write_png(clips / "still.png", 32, 32)
    for name in ("tone", "quiet", "damaged", "still"):
        (clips / f"{name}.txt").write_text(name, encoding="utf-8")
    path = root / "dataset.toml"
    path.write_text('resolutions = [32]\nframe_buckets = [1, 9]\n\n[[directory]]\npath = "clips"\n', encoding="utf-8")
    return path


def test_a_mixed_dataset_is_cached_with_its_sound_and_keyed_by_it(tmp_path: Path, caplog) -> None:
    dataset = _dataset(tmp_path)
    model = AudioModel(AudioSpec(RATE))
    registry = Registry()
    assert registry.register_model("reference-audio", model).ok
    plugin = registry.model("reference-audio")
    config = reference.ReferenceConfig(type="reference-audio", path=write_tiny_model(tmp_path / "model"))
    scan = scan_dataset(load_dataset_config(dataset), plugin.spec)

    # diffpipe data: per bucket, how many items have sound (a track, whether or not it decodes)
    report = format_report(scan, 1, 1).splitlines()
    assert report[1].split() == ["resolution", "frames", "items", "with", "sound", "micro-batches/rank", "remainder"]
    assert report[3].split()[:4] == ["32x32", "1", "1", "0"] and report[4].split()[:4] == ["32x32", "9", "3", "2"]

    with caplog.at_level("WARNING", logger="diffpipe.data"):
        ds = prepare_cache(dataset, plugin, config, decode_workers=0, progress=False, batch_size=4, strict=True)
    media = [b for b in model.batches if b.pixels is not None]
    videos = next(b for b in media if b.pixels.ndim == 5)
    assert videos.audio.shape == (3, 1, round(9 / 8 * RATE))
    assert sorted(videos.audio_present.tolist()) == [False, False, True]
    image = next(b for b in media if b.pixels.ndim == 4)
    assert image.audio.shape == (1, 1, RATE // 8) and not image.audio_present.any()
    assert any("damaged.mp4: audio stream #1 (aac) cannot be decoded" in r.getMessage() for r in caplog.records)

    rows = rows_by_id(ds)
    assert [rows[f"clips/{n}"]["audio_mask"].item() for n in ("tone.mp4", "quiet.mp4", "damaged.mp4", "still.png")] \
        == [1.0, 0.0, 0.0, 0.0]
    expected = torch.nn.functional.adaptive_avg_pool1d(torch.from_numpy(sine(9 / 8, 440.0, RATE))[None, None], 16)
    torch.testing.assert_close(rows["clips/tone.mp4"]["audio_latents"], expected[0], atol=0.02, rtol=0)

    # Only the sound of one clip changes (same frames, another tone): that clip alone is encoded again.
    write_video(tmp_path / "clips" / "tone.mp4", 12, 8, (32, 32), seed=1, audio="tone", tone_hz=660.0)
    model.batches.clear()
    again = prepare_cache(dataset, plugin, config, decode_workers=0, progress=False, batch_size=4, strict=True)
    assert again.summary["encoded_media_all_ranks"] == 1
    assert [b.audio.shape[0] for b in model.batches if b.pixels is not None] == [1]
    changed = rows_by_id(again)["clips/tone.mp4"]["audio_latents"]
    assert not torch.allclose(changed, rows["clips/tone.mp4"]["audio_latents"])

    # and the model's audio settings are part of every media key (a model without audio keys its cache apart)
    item = next(i for i in scan.items if i.path.name == "tone.mp4")
    keys = {media_key(item, "none", "fp")} | {media_key(item, "none", "fp", audio=a) for a in (
        AudioSpec(RATE), AudioSpec(16000), AudioSpec(RATE, 2))}
    assert len(keys) == 4
