"""Reading media: cheap probes for the scan, and full decoding to the bucket's size for caching.

Images go through Pillow (any mode; EXIF orientation applied; transparency composited on white),
videos through PyAV (resampled to the model's frame rate). Both are resized to cover the bucket and
center-cropped. Every failure is a :class:`MediaError` that names the file.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image, ImageOps

from diffpipe_core.data.archives import open_media
from diffpipe_core.data.items import DecodedMedia, MediaItem, PairedFile
from diffpipe_core.types import AudioSpec, ModelSpec

if TYPE_CHECKING:  # imported where used: `diffpipe validate` scans image datasets, and should start at once
    import torch

_ROTATED = {5, 6, 7, 8}  # EXIF orientations that swap width and height
_HIGH_DEPTH = {"I;16": 65535.0, "I;16L": 65535.0, "I;16B": 65535.0, "I;16N": 65535.0, "I": 65535.0, "F": 1.0}
_ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}


class MediaError(Exception):
    """A media file that cannot be read or decoded; the message names the file and why."""


class AudioError(MediaError):
    """A video's audio track that cannot be decoded; the message names the file and the stream."""


@dataclass(frozen=True)
class VideoInfo:
    """What the scan needs to know about a video without decoding it."""

    width: int
    height: int
    duration: float  # seconds
    fps: float  # native average frame rate
    audio_streams: int = 0  # audio tracks in the file (the first one is what a model with audio reads)


# ---------------------------------------------------------------------------------------------- probes


def _png_exif_after_pixels(path: Path) -> bytes | None:
    """The eXIf chunk of a PNG found by walking chunk headers (seeks, no decompression)."""
    with open(path, "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            return None
        while header := f.read(8):
            if len(header) < 8:
                return None
            length, kind = int.from_bytes(header[:4], "big"), header[4:]
            if kind == b"eXIf":
                data = f.read(length)
                return data if data.startswith(b"Exif\x00\x00") else b"Exif\x00\x00" + data
            if kind == b"IEND":
                return None
            f.seek(length + 4, 1)
    return None


def _orientation(im: Image.Image) -> int:
    try:
        if im.format == "PNG" and "exif" not in im.info:
            # Pillow's PngImageFile.getexif() decodes the whole image to look for a trailing eXIf chunk.
            data = _png_exif_after_pixels(Path(im.filename)) if getattr(im, "filename", None) else None
            if data is None:
                return 1
            exif = Image.Exif()
            exif.load(data)
            return int(exif.get(0x0112, 1) or 1)
        return int(im.getexif().get(0x0112, 1) or 1)
    except Exception:  # a broken EXIF block must not make the whole image unusable
        return 1


def probe_image(path: Path) -> tuple[int, int]:
    """(width, height) of an image as displayed (EXIF orientation applied), after checking that its
    pixel data is complete. Raises :class:`MediaError`; its ``kind`` attribute is ``"not media"`` when
    Pillow does not recognise the file at all."""
    try:
        with Image.open(open_media(path)) as im:
            w, h = im.size
            fmt = im.format
            if _orientation(im) in _ROTATED:
                w, h = h, w
            if fmt != "PNG":
                # JPEG decodes at 1/8 scale in draft mode: a cheap way to detect truncation.
                im.draft(None, (max(1, im.width // 8), max(1, im.height // 8)))
                im.load()
        if fmt == "PNG":
            with Image.open(open_media(path)) as im:
                im.verify()  # checks every chunk's CRC through IEND without decompressing
    except Image.UnidentifiedImageError as exc:
        err = MediaError(f"{path}: not an image Pillow recognises ({exc})")
        err.kind = "not media"  # type: ignore[attr-defined]
        raise err from None
    except Exception as exc:
        raise MediaError(f"{path}: corrupt or truncated image ({type(exc).__name__}: {exc})") from None
    if w < 1 or h < 1:
        raise MediaError(f"{path}: image has no pixels ({w}x{h})")
    return w, h


def probe_video(path: Path) -> VideoInfo:
    """Size, duration and frame rate of a video from its stream headers plus one decoded frame."""
    import av

    try:
        with av.open(open_media(path)) as container:
            if not container.streams.video:
                raise MediaError(f"{path}: has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            fps = float(rate) if rate else 0.0
            if stream.frames and fps > 0:
                duration = stream.frames / fps
            elif stream.duration and stream.time_base:
                duration = float(stream.duration * stream.time_base)
            elif container.duration:
                duration = container.duration / av.time_base
            else:
                raise MediaError(f"{path}: video duration is unknown")
            first = next(container.decode(stream), None)
            if first is None:
                raise MediaError(f"{path}: video has no decodable frames")
            w, h = first.width, first.height
            audio_streams = len(container.streams.audio)
    except MediaError:
        raise
    except Exception as exc:
        raise MediaError(f"{path}: corrupt or unreadable video ({type(exc).__name__}: {exc})") from None
    if fps <= 0:
        fps = 1.0 / max(duration, 1e-6)
    return VideoInfo(w, h, duration, fps, audio_streams)


# ---------------------------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class _Fit:
    """Resize (w0, h0) to cover (W, H), keeping aspect, then crop the center."""

    w0: int
    h0: int
    W: int
    H: int

    @property
    def resized(self) -> tuple[int, int]:
        scale = max(self.W / self.w0, self.H / self.h0)
        return max(self.W, round(self.w0 * scale)), max(self.H, round(self.h0 * scale))

    @property
    def crop(self) -> tuple[int, int]:
        rw, rh = self.resized
        return (rh - self.H) // 2, (rw - self.W) // 2

    def apply(self, im: Image.Image, resample: Image.Resampling) -> Image.Image:
        """Resize+crop in one pass; ``im`` may be smaller than (w0, h0) (a JPEG draft)."""
        rw, rh = self.resized
        top, left = self.crop
        fx, fy = im.width / rw, im.height / rh
        # clamp: float rounding must not push the box past the image
        box = (left * fx, top * fy, min(im.width, (left + self.W) * fx), min(im.height, (top + self.H) * fy))
        return im.resize((self.W, self.H), resample, box=box, reducing_gap=3.0)


def _flatten(im: Image.Image) -> tuple[Image.Image, float | None]:
    """An 8-bit RGB image, or a float 'F' gray image plus its full-scale value for high bit depths."""
    import numpy as np

    if im.mode in _HIGH_DEPTH:
        arr = np.asarray(im).astype(np.float32) / _HIGH_DEPTH[im.mode]
        return Image.fromarray(np.clip(arr, 0.0, 1.0), mode="F"), 1.0
    if im.mode in _ALPHA_MODES or "transparency" in im.info:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        background.alpha_composite(rgba)
        return background.convert("RGB"), None
    if im.mode != "RGB":
        return im.convert("RGB"), None
    return im, None


def _to_tensor(im: Image.Image, float_scale: float | None) -> torch.Tensor:
    import numpy as np
    import torch

    if float_scale is not None:  # gray float image in [0, 1]
        arr = np.clip(np.asarray(im, dtype=np.float32), 0.0, 1.0) * 2.0 - 1.0
        t = torch.from_numpy(arr.copy())[None].expand(3, -1, -1).contiguous()
        return t
    arr = np.asarray(im, dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(127.5).sub_(1.0)


def _open_oriented(path: Path, want: tuple[int, int] | None = None) -> tuple[Image.Image, tuple[int, int]]:
    """Open, let JPEG decode at a reduced scale no smaller than ``want`` (displayed w, h), apply EXIF
    orientation. Returns the image and the displayed original (w, h) before any reduction."""
    with Image.open(path) as raw:
        w, h = raw.size
        rotated = _orientation(raw) in _ROTATED
        if want is not None:
            dw, dh = (want[1], want[0]) if rotated else want
            raw.draft(None, (dw, dh))
        im = ImageOps.exif_transpose(raw)  # always a loaded copy, independent of the file
    return im, ((h, w) if rotated else (w, h))


def _load_mask(path: Path, fit: _Fit, item_id: str, stretch: bool = False) -> torch.Tensor:
    """The mask at the item's crop; ``stretch``: a mask of another size (a directory's default_mask_file) is
    resized to the media's size first, else a size mismatch is an error."""
    import numpy as np
    import torch

    try:
        mask, (mw, mh) = _open_oriented(path)
        if mask.mode in _HIGH_DEPTH:
            arr = np.asarray(mask).astype(np.float32) / _HIGH_DEPTH[mask.mode]
        else:
            arr = np.asarray(mask.convert("L"), dtype=np.float32) / 255.0
    except Exception as exc:
        raise MediaError(f"{item_id}: mask {path} is unreadable ({type(exc).__name__}: {exc})") from None
    if (mw, mh) != (fit.w0, fit.h0) and stretch:
        arr = np.asarray(Image.fromarray(arr, mode="F").resize((fit.w0, fit.h0), Image.Resampling.BILINEAR))
    elif (mw, mh) != (fit.w0, fit.h0):
        raise MediaError(f"{item_id}: mask {path} is {mw}x{mh} but the media is {fit.w0}x{fit.h0}")
    plane = fit.apply(Image.fromarray(arr, mode="F"), Image.Resampling.BILINEAR)
    return torch.from_numpy(np.clip(np.asarray(plane, dtype=np.float32), 0.0, 1.0).copy())[None]


# ---------------------------------------------------------------------------------------------- decode


def load_media(item: MediaItem, spec: ModelSpec, audio: AudioSpec | None = None) -> DecodedMedia:
    """Decode ``item`` at its bucket's size: ``(C, H, W)`` for images, ``(C, F, H, W)`` for videos, float32
    in [-1, 1]; plus its mask ``(1, H, W)`` in [0, 1] if it has one and, with ``audio`` (the model's
    :class:`~diffpipe_core.types.AudioSpec`), the sound of the frames' span (:func:`load_audio`; zeros marked absent
    for an image). Raises :class:`MediaError`."""
    if item.bucket.frames > 1 or item.clip_start is not None:
        decoded = _load_video(item, spec, audio)
    else:
        decoded = _load_image(item)
        if audio is not None:
            decoded.audio = _silence(audio, 1, float(spec.video_fps or 1.0))
    for file in item.paired:
        decoded.paired.setdefault(file.role, []).append(load_paired(item, file, spec))
    return decoded


def load_paired(item: MediaItem, file: PairedFile, spec: ModelSpec) -> torch.Tensor:
    """One paired file of ``item`` (``ModelSpec.paired_files``): a control mask ``(1, F, H, W)`` in [0, 1] at the
    item's frames, bucket and crop (its first channel; a mask image held over every frame); a reference image or last
    frame ``(3, h, w)`` in [-1, 1] at the file's own size (EXIF orientation applied). Raises :class:`MediaError`
    naming the item and the file."""
    what = file.role.replace("_", " ")
    if file.role == "control_mask":
        source = replace(item, id=f"{what} of {item.id}", path=file.path, mask_path=None, paired=())
        if file.video:
            plane = _load_video(source, spec).pixels[:1]
        else:
            still = _load_image(replace(source, bucket=replace(item.bucket, frames=1), clip_start=None)).pixels[:1]
            plane = still[:, None].expand(-1, item.bucket.frames, -1, -1).contiguous()
        return ((plane + 1) / 2).clamp_(0.0, 1.0)
    try:
        im, _ = _open_oriented(file.path)  # a plain file: paired folders are listed on disk, not in archives
        flat, scale = _flatten(im)
        return _to_tensor(flat, scale).clamp_(-1.0, 1.0)
    except Exception as exc:
        raise MediaError(f"{item.id}: cannot decode its {what} {file.path} ({type(exc).__name__}: {exc})") from None


def _silence(audio: AudioSpec, frames: int, fps: float) -> torch.Tensor:
    import torch

    return torch.zeros(audio.channels, audio.samples(frames, fps))


def load_audio(path: Path, audio: AudioSpec, start: float, frames: int, fps: float) -> torch.Tensor | None:
    """The first audio track of video ``path`` over the span of ``frames`` frames at ``fps`` from ``start`` seconds
    (the video stream's timeline, as the frames are taken), resampled to ``audio.sample_rate`` and mixed to
    ``audio.channels``: ``(channels, S)`` float32, ``S = audio.samples(frames, fps)``, silence-padded where the
    track ends early or starts late; None when the file has no audio track. Raises :class:`AudioError`, naming the
    file and the stream, when the track cannot be decoded (corrupt, or a codec this PyAV lacks)."""
    import av
    import numpy as np
    import torch

    count = audio.samples(frames, fps)
    rate = audio.sample_rate
    with av.open(open_media(path)) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        what = f"audio stream #{stream.index} ({stream.codec_context.name if stream.codec_context else '?'})"
        video = container.streams.video[0] if container.streams.video else None
        offset = float(video.start_time * video.time_base) if video is not None and video.start_time is not None \
            and video.time_base else 0.0
        t0 = start + offset  # the span on the container's timeline
        end = t0 + count / rate
        chunks: list[np.ndarray] = []
        first: float | None = None
        try:
            mono = audio.channels == 1 or stream.codec_context.channels == 1  # a mono track is duplicated, not upmixed
            resampler = av.AudioResampler(format="fltp", layout="mono" if mono else "stereo", rate=rate)
            for frame in container.decode(stream):
                if first is None:
                    first = float(frame.time) if frame.time is not None else 0.0
                chunks += [out.to_ndarray() for out in resampler.resample(frame)]
                if first + sum(c.shape[1] for c in chunks) / rate >= end + 0.05:
                    break
            chunks += [out.to_ndarray() for out in resampler.resample(None)]
        except Exception as exc:
            raise AudioError(f"{path}: {what} cannot be decoded ({type(exc).__name__}: {exc})") from None
    if first is None:
        raise AudioError(f"{path}: {what} has no decodable audio")
    wave = np.concatenate(chunks, axis=1) if chunks else np.zeros((audio.channels, 0), np.float32)
    if wave.shape[0] != audio.channels:
        wave = np.repeat(wave, audio.channels, axis=0)
    out = np.zeros((audio.channels, count), np.float32)
    i0 = round((t0 - first) * rate)  # the span's first sample in the decoded audio
    lo, hi = max(i0, 0), min(i0 + count, wave.shape[1])
    if hi > lo:
        out[:, lo - i0 : hi - i0] = wave[:, lo:hi]
    return torch.from_numpy(out).clamp_(-1.0, 1.0)


def _load_image(item: MediaItem) -> DecodedMedia:
    W, H = item.bucket.width, item.bucket.height
    try:
        with Image.open(open_media(item.path)) as raw:
            w, h = raw.size
            rotated = _orientation(raw) in _ROTATED
            if rotated:
                w, h = h, w
            fit = _Fit(w, h, W, H)
            rw, rh = fit.resized
            raw.draft(None, (rh, rw) if rotated else (rw, rh))  # JPEG: decode at a reduced scale >= needed
            im = ImageOps.exif_transpose(raw)
        flat, scale = _flatten(im)
        out = fit.apply(flat, Image.Resampling.LANCZOS)
        pixels = _to_tensor(out, scale).clamp_(-1.0, 1.0)
    except MediaError:
        raise
    except Exception as exc:
        raise MediaError(f"{item.id}: cannot decode {item.path} ({type(exc).__name__}: {exc})") from None
    mask = _load_mask(item.mask_path, fit, item.id, item.mask_stretched) if item.mask_path else None
    return DecodedMedia(pixels=pixels, mask=mask, original_size=(h, w), crop_coords=fit.crop)


def _load_video(item: MediaItem, spec: ModelSpec, audio: AudioSpec | None = None) -> DecodedMedia:
    import av

    W, H, F = item.bucket.width, item.bucket.height, item.bucket.frames
    start = item.clip_start or 0.0
    try:
        with av.open(open_media(item.path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            tb = stream.time_base or Fraction(1, 1000)
            native = float(stream.average_rate or stream.guessed_rate or 0) or 25.0
            fps = float(spec.video_fps) if spec.video_fps else native
            offset = float(stream.start_time * tb) if stream.start_time is not None else 0.0
            if start > 0:
                container.seek(int((start + offset) / tb), stream=stream, backward=True, any_frame=False)
            targets = [start + k / fps for k in range(F)]
            chosen: list[av.VideoFrame] = []
            prev: tuple[float, av.VideoFrame] | None = None
            for n, frame in enumerate(container.decode(stream)):
                t = (frame.time - offset) if frame.time is not None else n / native
                # each target time takes the source frame nearest to it
                while len(chosen) < F and t >= targets[len(chosen)] - 1e-6:
                    tk = targets[len(chosen)]
                    use_prev = prev is not None and abs(prev[0] - tk) < abs(t - tk)
                    chosen.append(prev[1] if use_prev else frame)  # type: ignore[index]
                if len(chosen) == F:
                    break
                prev = (t, frame)
            while len(chosen) < F and prev is not None and targets[len(chosen)] - prev[0] <= 1.5 / native:
                chosen.append(prev[1])  # the last frame is still on screen at this time
    except Exception as exc:
        raise MediaError(
            f"{item.id}: cannot decode video {item.path} ({type(exc).__name__}: {exc})"
        ) from None
    if len(chosen) < F:
        raise MediaError(
            f"{item.id}: video {item.path} ended after {len(chosen)} of the {F} frames needed from "
            f"{start:.3f}s at {fps:g} fps (is the file truncated?)"
        )
    first = chosen[0]
    fit = _Fit(first.width, first.height, W, H)
    import torch

    converted: dict[int, torch.Tensor] = {}
    planes = []
    for frame in chosen:
        key = id(frame)
        if key not in converted:
            converted[key] = _to_tensor(fit.apply(frame.to_image(), Image.Resampling.LANCZOS), None)
        planes.append(converted[key])
    pixels = torch.stack(planes, dim=1).clamp_(-1.0, 1.0)  # (C, F, H, W)
    mask = _load_mask(item.mask_path, fit, item.id, item.mask_stretched) if item.mask_path else None
    decoded = DecodedMedia(pixels=pixels, mask=mask, original_size=(fit.h0, fit.w0), crop_coords=fit.crop)
    if audio is not None:
        try:
            wave, why = load_audio(item.path, audio, start, F, fps), None
        except Exception as exc:  # the container opened for the frames above: anything here is the audio's fault
            why = str(exc) if isinstance(exc, AudioError) else \
                f"{item.path}: audio unreadable ({type(exc).__name__}: {exc})"
            if audio.damaged == "skip":
                raise MediaError(f"{item.id}: damaged audio, left out (the model needs readable audio): {why}") \
                    from None
            wave, why = None, f"{why}; trains without audio"
        decoded.audio = wave if wave is not None else _silence(audio, F, fps)
        decoded.audio_present, decoded.audio_note = wave is not None, why
    return decoded
