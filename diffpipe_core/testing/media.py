"""Tiny on-disk datasets for tests: PNG images with caption files, and a dataset TOML."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image


def write_png(path: Path, width: int, height: int, seed: int = 0) -> Path:
    """A smooth random RGB image (so resizing does not alias it into noise)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    Image.fromarray(coarse).resize((width, height), Image.BILINEAR).save(path)
    return path


def write_image_dataset(
    folder: Path,
    n: int,
    size: tuple[int, int] | Sequence[tuple[int, int]] = (64, 64),
    captions: Sequence[str] | None = None,
    seed: int = 0,
) -> list[Path]:
    """Write ``n`` PNGs ``img_000.png``... with ``img_000.txt`` captions into ``folder``; return the PNG paths.

    ``size`` is one ``(width, height)`` or one per image; ``captions`` defaults to ``"caption i"``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    sizes = [size] * n if isinstance(size[0], int) else list(size)  # type: ignore[index]
    if len(sizes) != n:
        raise ValueError(f"{len(sizes)} sizes for {n} images")
    paths = []
    for i in range(n):
        w, h = sizes[i]  # type: ignore[misc]
        path = write_png(folder / f"img_{i:03d}.png", w, h, seed=seed * 100_003 + i)
        caption = captions[i] if captions is not None else f"caption {i}"
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
        paths.append(path)
    return paths


def write_dataset_toml(
    path: Path, directory: Path, directory_keys: dict[str, object] | None = None, **keys: object
) -> Path:
    """A minimal dataset TOML with one ``[[directory]]`` (plus ``directory_keys`` such as ``num_repeats``);
    ``keys`` become top-level keys (numbers, bools, strings and lists of them)."""

    def fmt(value: object) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str | Path):
            return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(value, list | tuple):
            return "[" + ", ".join(fmt(v) for v in value) + "]"
        return repr(value)

    lines = [f"{k} = {fmt(v)}" for k, v in keys.items()]
    lines += ["", "[[directory]]", f"path = {fmt(directory)}"]
    lines += [f"{k} = {fmt(v)}" for k, v in (directory_keys or {}).items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


AUDIO_RATE = 16000
"""Sample rate of the audio tracks :func:`write_video` writes."""


def tone(seconds: float, hz: float, rate: int = AUDIO_RATE, start: float = 0.0, amplitude: float = 0.5) -> np.ndarray:
    """A sine of ``hz`` from time ``start`` for ``seconds`` at ``rate``: ``amplitude * sin(2 pi hz t)``, float32."""
    t = start + np.arange(round(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def write_video(
    path: Path, frames: int, fps: int = 16, size: tuple[int, int] = (64, 64), seed: int = 0,
    audio: str | None = None, tone_hz: float = 440.0,
) -> Path:
    """An mp4 (``size`` = (width, height)) of ``frames`` smooth random RGB frames at ``fps``, written with PyAV.

    ``audio``: None (no audio track), ``"tone"`` (an AAC track of a ``tone_hz`` sine, :func:`tone`, at
    :data:`AUDIO_RATE`, as long as the video), ``"silent"`` (the same track, all zeros) or ``"damaged"`` (the tone
    track with its packets overwritten by noise after writing: no decoder reads it, the frames stay intact)."""
    from fractions import Fraction

    import av

    if audio not in (None, "tone", "silent", "damaged"):
        raise ValueError(f"write_video: audio is {audio!r}; valid: None, 'tone', 'silent', 'damaged'")
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        sound = None
        if audio is not None:
            sound = container.add_stream("aac", rate=AUDIO_RATE, layout="mono")
        for _ in range(frames):
            coarse = rng.integers(0, 256, size=(max(2, size[1] // 8), max(2, size[0] // 8), 3), dtype=np.uint8)
            frame = np.asarray(Image.fromarray(coarse).resize(size, Image.BILINEAR))
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
        if sound is not None:
            wave = tone(frames / fps, tone_hz) * (0.0 if audio == "silent" else 1.0)
            block = 1024
            for at in range(0, len(wave), block):
                chunk = wave[at : at + block][None]
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(chunk), format="flt", layout="mono")
                frame.sample_rate, frame.pts, frame.time_base = AUDIO_RATE, at, Fraction(1, AUDIO_RATE)
                container.mux(sound.encode(frame))
            container.mux(sound.encode())
    if audio == "damaged":
        _damage_audio(path, rng)
    return path


def _damage_audio(path: Path, rng: np.random.Generator) -> None:
    """Overwrite every audio packet of ``path`` in place with random bytes (the container stays valid)."""
    import av

    with av.open(str(path)) as container:
        spans = [(p.pos, p.size) for p in container.demux(container.streams.audio[0]) if p.pos is not None and p.size]
    data = bytearray(path.read_bytes())
    for pos, size in spans:
        data[pos : pos + size] = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))


def best_codec() -> str:
    """H.264 where this PyAV build can write it, else MPEG-4 part 2."""
    import av

    try:
        av.codec.Codec("libx264", "w")
        return "libx264"
    except Exception:
        return "mpeg4"


def write_drifting_video(
    path: Path, frames: int, fps: int = 8, size: tuple[int, int] = (64, 64), seed: int = 0
) -> Path:
    """An mp4 (``size`` = (width, height)) of a smooth random colour field drifting sideways: frames that follow one
    another, as a camera pan does (H.264 where PyAV has it, else MPEG-4)."""
    from fractions import Fraction

    import av

    rng = np.random.default_rng(seed)
    w, h = size
    coarse = rng.integers(0, 256, size=(4, 8, 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((2 * w, h), Image.BILINEAR))
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(best_codec(), rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(frames):
            frame = np.ascontiguousarray(field[:, (2 * i) % w : (2 * i) % w + w])
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def write_clip_dataset(
    folder: Path,
    frames: int | list[int],
    captions: list[str] | tuple[str, ...],
    size: tuple[int, int] = (64, 64),
    fps: int = 8,
    drifting: bool = False,
    audio: str | None = None,
    tone_hz: float = 440.0,
) -> list[Path]:
    """``clip_000.mp4``, ... with ``.txt`` captions in ``folder``, one clip per caption (``frames`` each, or one count
    per clip): random frames (:func:`write_video`, with its ``audio`` track and ``tone_hz``) or a drifting field
    (:func:`write_drifting_video`, silent)."""
    counts = [frames] * len(captions) if isinstance(frames, int) else list(frames)
    if drifting and audio is not None:
        raise ValueError("write_clip_dataset: drifting clips have no audio track")
    sound = {} if drifting else {"audio": audio, "tone_hz": tone_hz}
    writer = write_drifting_video if drifting else write_video
    paths = []
    for i, (n, caption) in enumerate(zip(counts, captions, strict=True)):
        path = writer(Path(folder) / f"clip_{i:03d}.mp4", n, fps, size, seed=i, **sound)
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
        paths.append(path)
    return paths


def assert_video_sample_point(folder: Path, fps: int, frames: int, name: str = "00-a-red-cat") -> None:
    """A sampling point's folder (``samples/step-N``) of one prompt's video: ``name.mp4`` (PyAV decodes ``frames``
    frames at ``fps``), the contact sheet, the latents and the prompts, and nothing else."""
    from fractions import Fraction

    import av

    files = sorted(p.name for p in folder.iterdir())
    assert files == [f"{name}.mp4", "contact-sheet.png", "latents.safetensors", "prompts.json"], files
    with av.open(str(folder / f"{name}.mp4")) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == Fraction(fps), stream.average_rate
        assert len(list(container.decode(stream))) == frames
