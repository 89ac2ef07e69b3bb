"""Writing samples: PNG for images, MP4 (PyAV, H.264 when available) for videos, and TensorBoard images."""

from __future__ import annotations

import io
import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffpipe_core.atomic import atomic_write_bytes, atomic_write_text

MAX_TENSORBOARD_FRAMES = 8


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


def mp4_bytes(frames: np.ndarray, fps: float) -> bytes:
    """An MP4 of ``(F, H, W, 3)`` uint8 frames (H.264 if this PyAV has it, else MPEG-4 part 2)."""
    import av

    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "18"}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def write_sample(path_stem: Path, sample: np.ndarray, fps: float) -> Path:
    """``<stem>.png`` for an image, ``<stem>.mp4`` for a video (written atomically); returns the path."""
    if sample.ndim == 3:
        path = path_stem.with_suffix(".png")
        atomic_write_bytes(path, png_bytes(sample))
    else:
        path = path_stem.with_suffix(".mp4")
        atomic_write_bytes(path, mp4_bytes(sample, fps))
    return path


def write_prompts(folder: Path, prompts: list[str], extra: dict[str, Any]) -> None:
    """``prompts.json`` beside the samples: which file shows which prompt, and how it was made."""
    atomic_write_text(folder / "prompts.json", json.dumps({"prompts": prompts, **extra}, indent=2) + "\n")


def log_sample(writer: Any, tag: str, sample: np.ndarray, step: int) -> None:
    """An image as is; a video as a strip of up to 8 evenly spaced frames (TensorBoard video needs moviepy)."""
    if sample.ndim == 4:
        picks = np.linspace(0, sample.shape[0] - 1, min(MAX_TENSORBOARD_FRAMES, sample.shape[0])).round().astype(int)
        sample = np.concatenate([sample[i] for i in picks], axis=1)
    writer.add_image(tag, sample, step, dataformats="HWC")
