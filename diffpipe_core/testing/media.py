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


def write_video(path: Path, frames: int, fps: int = 16, size: tuple[int, int] = (64, 64), seed: int = 0) -> Path:
    """An mp4 (``size`` = (width, height)) of ``frames`` smooth random RGB frames at ``fps``, written with PyAV."""
    from fractions import Fraction

    import av

    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for _ in range(frames):
            coarse = rng.integers(0, 256, size=(max(2, size[1] // 8), max(2, size[0] // 8), 3), dtype=np.uint8)
            frame = np.asarray(Image.fromarray(coarse).resize(size, Image.BILINEAR))
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


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
) -> list[Path]:
    """``clip_000.mp4``, ... with ``.txt`` captions in ``folder``, one clip per caption (``frames`` each, or one count
    per clip): random frames (:func:`write_video`) or a drifting field (:func:`write_drifting_video`)."""
    counts = [frames] * len(captions) if isinstance(frames, int) else list(frames)
    writer = write_drifting_video if drifting else write_video
    paths = []
    for i, (n, caption) in enumerate(zip(counts, captions, strict=True)):
        path = writer(Path(folder) / f"clip_{i:03d}.mp4", n, fps, size, seed=i)
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
