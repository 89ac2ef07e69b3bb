"""Issue 40, samples with sound: a model's ``decode_audio`` is muxed into the sample's MP4 (AAC, PyAV) and logged to
TensorBoard's audio tab; a model without it writes silent MP4s as before."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import torch

from diffpipe_core import hookimpl
from diffpipe_core.engine.metrics_writer import MetricsWriter
from diffpipe_core.registry import Registry
from diffpipe_core.sampling.decoder import HeldDecoder
from diffpipe_core.sampling.output import log_sampling_point
from diffpipe_core.sampling.runner import write_samples
from diffpipe_core.testing.media import tone
from diffpipe_core.testing.specs import TINY_VIDEO_SPEC
from diffpipe_core.types import SampleRequest

RATE, FPS, FRAMES = 16000, 8.0, 9


class Silent:
    """A decoder-only video model: its latents are the pixels."""

    spec = TINY_VIDEO_SPEC

    @hookimpl
    def model_spec(self):
        return self.spec

    @hookimpl
    def load_decoder(self, model_config, device):
        return torch.nn.Identity()

    @hookimpl
    def decode_latents(self, decoder, latents):
        return decoder(latents)



class Sounding(Silent):
    """The same, and its decoder also gives a 440 Hz tone of the video's length (stereo)."""

    @hookimpl
    def decode_audio(self, decoder, latents):
        return torch.from_numpy(tone(FRAMES / FPS, 440.0, RATE))[None, None].expand(1, 2, -1), RATE


class Board:
    """What ``log_sampling_point`` hands a writer that takes audio."""

    def __init__(self) -> None:
        self.audio: list[tuple[str, np.ndarray, int, int]] = []

    def add_image(self, *args, **kwargs) -> None:
        pass

    def add_audio(self, tag, audio, step, sample_rate) -> None:
        self.audio.append((tag, audio, step, sample_rate))

    def flush(self) -> None:
        pass


def _written(tmp_path: Path, sound: bool):
    registry = Registry()
    assert registry.register_model("tinyvideo", Sounding() if sound else Silent()).ok
    plugin = registry.model("tinyvideo")
    latents = {0: torch.rand(1, 3, FRAMES, 32, 32) * 2 - 1}
    out = tmp_path / ("sound" if sound else "silent")
    return write_samples(HeldDecoder(plugin, None, torch.device("cpu")), latents, ["a bell"],
                         SampleRequest(32, 32, FRAMES, steps=1), out, FPS, step=3)


def test_a_samples_sound_is_muxed_into_its_mp4_and_logged(tmp_path: Path) -> None:
    point = _written(tmp_path, sound=True)
    (file,) = point.files
    with av.open(str(file)) as container:
        assert len(list(container.decode(container.streams.video[0]))) == FRAMES
    with av.open(str(file)) as container:
        stream = container.streams.audio[0]
        assert (stream.codec_context.name, stream.rate, stream.codec_context.channels) == ("aac", RATE, 2)
        wave = np.concatenate([f.to_ndarray() for f in container.decode(stream)], axis=1)
    # the track lasts as long as the video (AAC pads the last frame: within one frame of 1024 samples)
    assert abs(wave.shape[1] - FRAMES / FPS * RATE) <= 1024
    expected = tone(FRAMES / FPS, 440.0, RATE)
    inner = slice(2048, len(expected) - 2048)
    assert np.corrcoef(wave[0, inner], expected[inner])[0, 1] > 0.99

    board = Board()
    log_sampling_point(board, point)
    ((tag, mono, step, rate),) = board.audio
    assert (tag, step, rate, mono.shape) == ("samples/00/audio", 3, RATE, (1, len(expected)))
    # through the run's writer into TensorBoard's audio tab
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = MetricsWriter(SummaryWriter(str(tmp_path / "tb")))
    log_sampling_point(writer, point)
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"audio": 0})
    events.Reload()
    (logged,) = events.Audio("samples/00/audio")
    assert (logged.step, logged.sample_rate, logged.length_frames) == (3, RATE, len(expected))

    silent = _written(tmp_path, sound=False)  # no decode_audio: a silent MP4, nothing logged
    with av.open(str(silent.files[0])) as container:
        assert not container.streams.audio
    board = Board()
    log_sampling_point(board, silent)
    assert board.audio == []


def test_a_rate_aac_lacks_is_resampled_to_one_it_has() -> None:
    """A model whose audio rate AAC cannot store (a tiny test model at 800 Hz) still writes its sound: resampled to
    the next AAC rate, the tone kept."""
    from diffpipe_core.sampling.output import AAC_RATES, aac_ready, mp4_bytes

    wave = tone(1.0, 50.0, 800)[None].astype(np.float32)
    ready, rate = aac_ready(wave, 800)
    assert rate == 7350 and ready.shape == (1, 7350)
    assert np.corrcoef(ready[0], tone(1.0, 50.0, 7350))[0, 1] > 0.999
    assert aac_ready(wave, 8000)[1] == 8000 and aac_ready(wave, 200_000)[1] == AAC_RATES[-1]
    frames = np.zeros((24, 32, 32, 3), np.uint8)
    import io

    with av.open(io.BytesIO(mp4_bytes(frames, 24.0, wave, 800))) as container:
        assert container.streams.audio[0].rate == 7350
