"""Writing samples: PNG for images, MP4 (PyAV, H.264 when available) at the model's frame rate for videos, the
contact sheet, and handing a sampling point to the loggers (:func:`log_sampling_point`, TensorBoard)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffpipe_core.atomic import atomic_write_bytes, atomic_write_text

MAX_TENSORBOARD_FRAMES = 8
CONTACT_SHEET = "contact-sheet.png"
"""The contact sheet's file name in a sampling point's folder."""


@dataclass
class WrittenSample:
    """One sample of a sampling point, as written: its prompt, file, and a still (an image, or a video's first
    frame) and, for a video, a strip of up to :data:`MAX_TENSORBOARD_FRAMES` frames side by side."""

    index: int
    prompt: str
    file: Path
    still: np.ndarray
    strip: np.ndarray | None = None
    frames: int = 1
    audio: np.ndarray | None = None  # (channels, S) float32 in [-1, 1], muxed into the mp4
    sample_rate: int = 0


@dataclass
class SamplingPoint:
    """Everything one sampling point wrote: the folder, the samples, the contact sheet (image and file) and the
    frame rate of video samples. ``step`` is None outside training (``diffpipe sample``)."""

    folder: Path
    step: int | None
    fps: float
    samples: list[WrittenSample] = field(default_factory=list)
    contact_sheet: np.ndarray | None = None
    contact_sheet_file: Path | None = None

    @property
    def files(self) -> list[Path]:
        return [s.file for s in self.samples]


def to_uint8(pixels: torch.Tensor) -> np.ndarray:
    """One decoded sample in [-1, 1], ``(3, H, W)`` or ``(3, F, H, W)``, as uint8 ``(H, W, 3)`` or ``(F, H, W, 3)``."""
    x = ((pixels.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    if x.dim() == 3:
        return x.permute(1, 2, 0).numpy()
    if x.dim() == 4:
        return x.permute(1, 2, 3, 0).numpy()
    raise ValueError(f"decode_latents must give (B, 3, H, W) or (B, 3, F, H, W) pixels; one sample is {tuple(x.shape)}")


def png_bytes(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def mp4_bytes(frames: np.ndarray, fps: float, audio: np.ndarray | None = None, sample_rate: int = 0) -> bytes:
    """An MP4 of ``(F, H, W, 3)`` uint8 frames (H.264 if this PyAV has it, else MPEG-4 part 2) and, with ``audio``
    (``(channels, S)`` float in [-1, 1], 1 or 2 channels, at ``sample_rate``), an AAC track of that sound."""
    import av

    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "18"}
        if audio is not None:
            audio, sample_rate = aac_ready(audio, sample_rate)
        sound = _audio_stream(container, audio, sample_rate) if audio is not None else None
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())
        if sound is not None:
            _mux_audio(container, sound, audio, sample_rate)  # type: ignore[arg-type]
    return buf.getvalue()


#: the sample rates an AAC track can have (MPEG-4's sampling frequency table)
AAC_RATES = (7350, 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)


def aac_ready(audio: np.ndarray, sample_rate: int) -> tuple[np.ndarray, int]:
    """``audio`` at a rate AAC takes: as it is where ``sample_rate`` is one, else resampled (linearly) to the next
    higher one (96 kHz above that), so a model with an unusual rate still writes its sample's sound."""
    if sample_rate in AAC_RATES or sample_rate < 1:
        return audio, sample_rate
    rate = next((r for r in AAC_RATES if r > sample_rate), AAC_RATES[-1])
    length = max(1, round(audio.shape[-1] * rate / sample_rate))
    at = np.arange(length) * (sample_rate / rate)
    source = np.arange(audio.shape[-1])
    return np.stack([np.interp(at, source, channel) for channel in np.asarray(audio, np.float32)]), rate


def _audio_stream(container: Any, audio: np.ndarray, sample_rate: int) -> Any:
    if audio.ndim != 2 or audio.shape[0] not in (1, 2) or sample_rate < 1:
        raise ValueError(f"sample audio must be (1 or 2 channels, samples) at a positive rate; got shape "
                         f"{audio.shape} at {sample_rate} Hz")
    return container.add_stream("aac", rate=sample_rate, layout="mono" if audio.shape[0] == 1 else "stereo")


def _mux_audio(container: Any, stream: Any, audio: np.ndarray, sample_rate: int) -> None:
    import av

    layout = "mono" if audio.shape[0] == 1 else "stereo"
    wave = np.clip(audio.astype(np.float32), -1.0, 1.0)
    block = stream.codec_context.frame_size or 1024
    for at in range(0, wave.shape[1], block):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, at : at + block]), format="fltp", layout=layout)
        frame.sample_rate, frame.pts, frame.time_base = sample_rate, at, Fraction(1, sample_rate)
        container.mux(stream.encode(frame))
    container.mux(stream.encode())


def write_sample(path_stem: Path, sample: np.ndarray, fps: float, audio: np.ndarray | None = None,
                 sample_rate: int = 0) -> Path:
    """``<stem>.png`` for an image, ``<stem>.mp4`` for a video, with ``audio`` (``(channels, S)`` at
    ``sample_rate``) as its sound track (written atomically); returns the path."""
    if sample.ndim == 3:
        path = path_stem.with_suffix(".png")
        atomic_write_bytes(path, png_bytes(sample))
    else:
        path = path_stem.with_suffix(".mp4")
        atomic_write_bytes(path, mp4_bytes(sample, fps, audio, sample_rate))
    return path


def write_prompts(folder: Path, prompts: list[str], extra: dict[str, Any]) -> None:
    """``prompts.json`` beside the samples: which file shows which prompt, and how it was made."""
    atomic_write_text(folder / "prompts.json", json.dumps({"prompts": prompts, **extra}, indent=2) + "\n")


def frame_strip(video: np.ndarray) -> np.ndarray:
    """Up to :data:`MAX_TENSORBOARD_FRAMES` evenly spaced frames of ``(F, H, W, 3)``, side by side: ``(H, k*W, 3)``."""
    picks = np.linspace(0, video.shape[0] - 1, min(MAX_TENSORBOARD_FRAMES, video.shape[0])).round().astype(int)
    return np.concatenate([video[i] for i in picks], axis=1)


def log_sampling_point(writer: Any, point: SamplingPoint) -> None:
    """Hand one sampling point's samples to the loggers: TensorBoard ``samples/NN`` (an image as is, a video as
    its frame strip: TensorBoard video needs moviepy), a video's sound as ``samples/NN/audio`` (mono, where the
    writer takes audio: ``add_audio``) and ``samples/contact_sheet``. The one place a logger of samples (W&B, ...) is
    added."""
    if writer is None or point.step is None:
        return
    for sample in point.samples:
        image = sample.strip if sample.strip is not None else sample.still
        writer.add_image(f"samples/{sample.index:02d}", image, point.step, dataformats="HWC")
        if sample.audio is not None and hasattr(writer, "add_audio"):
            mono = np.clip(sample.audio.mean(axis=0, keepdims=True), -1.0, 1.0)
            writer.add_audio(f"samples/{sample.index:02d}/audio", mono, point.step, sample_rate=sample.sample_rate)
    if point.contact_sheet is not None:
        writer.add_image("samples/contact_sheet", point.contact_sheet, point.step, dataformats="HWC")
    writer.flush()
