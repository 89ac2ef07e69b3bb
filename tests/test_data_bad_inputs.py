"""Acceptance 4: every bad input, one by one. Each is used correctly or left out with a warning that
names it, the scan goes on with the good files, and the summary counts it."""

from __future__ import annotations

import logging
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from diffpipe_core.data.dataset_config import load_dataset_config
from diffpipe_core.data.decode import load_media
from diffpipe_core.data.items import ScanResult
from diffpipe_core.data.report import format_report
from diffpipe_core.data.scan import DatasetError, scan_dataset
from diffpipe_core.schema import ConfigError
from diffpipe_core.testing.specs import TINY_VIDEO_SPEC
from diffpipe_core.types import ModelConfigBase, ModelSpec

IMAGE = ModelSpec(name="img", modality="image", config_schema=ModelConfigBase, spatial_multiple=16)
VIDEO = TINY_VIDEO_SPEC


def image(path: Path, size: tuple[int, int] = (64, 64), caption: str | None = "ok", fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = (np.arange(size[0] * size[1] * 3) % 251).astype(np.uint8).reshape(size[1], size[0], 3)
    Image.fromarray(arr).save(path, format=fmt)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def video(path: Path, frames: int, caption: str = "a clip") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(8))
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            arr = np.random.default_rng(i).integers(0, 255, (48, 64, 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")))
        container.mux(stream.encode())
    path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def scan(tmp_path: Path, spec: ModelSpec = IMAGE, extra: str = "") -> ScanResult:
    toml = tmp_path / "dataset.toml"
    toml.write_text(
        f'resolutions = [64]\nframe_buckets = [1, 9, 17]\n{extra}\n[[directory]]\npath = "data"\n'
        + ('mask_path = "masks"\n' if (tmp_path / "masks").is_dir() else ""),
        encoding="utf-8",
    )
    return scan_dataset(load_dataset_config(toml), spec)


def only_skip(result: ScanResult, name: str, category: str, caplog: pytest.LogCaptureFixture) -> str:
    """The bad file is the only one left out, with this category; a warning names it; the good file is
    still used; the report's summary counts it. Returns the reason."""
    assert [s.path.name for s in result.skipped] == [name]
    reason = result.skipped[0].reason
    assert reason.startswith(category + ":"), reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(name in w and reason in w for w in warnings), warnings
    assert "good.png" in {i.path.name for i in result.items}
    report = format_report(result, micro_batch_size=1, dp_world_size=1)
    assert name in report and f"1 file left out (1 {category})" in report
    return reason


@pytest.fixture(autouse=True)
def _good_file(tmp_path: Path) -> None:
    image(tmp_path / "data" / "good.png")


def test_truncated_png(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = image(tmp_path / "data" / "cut.png", (128, 128))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert "truncated" in only_skip(scan(tmp_path), "cut.png", "unreadable", caplog)


def test_truncated_jpeg(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = image(tmp_path / "data" / "cut.jpg", (256, 256))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    only_skip(scan(tmp_path), "cut.jpg", "unreadable", caplog)


def test_corrupt_image_bytes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = image(tmp_path / "data" / "garbled.png", (128, 128))
    data = bytearray(path.read_bytes())
    data[200:260] = bytes(60)  # inside the pixel data: the chunk CRC no longer matches
    path.write_bytes(bytes(data))
    only_skip(scan(tmp_path), "garbled.png", "unreadable", caplog)


def test_truncated_video(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = video(tmp_path / "data" / "cut.mp4", 20)
    video(tmp_path / "data" / "whole.mp4", 20)
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    result = scan(tmp_path, VIDEO)
    only_skip(result, "cut.mp4", "unreadable", caplog)
    assert "whole.mp4" in {i.path.name for i in result.items}


def test_zero_byte_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "data" / "empty.png").write_bytes(b"")
    (tmp_path / "data" / "empty.txt").write_text("caption", encoding="utf-8")
    only_skip(scan(tmp_path), "empty.png", "empty file", caplog)


def test_not_media_with_an_image_extension(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "data" / "notes.jpg").write_text("this is a text file, not a JPEG\n" * 20, encoding="utf-8")
    (tmp_path / "data" / "notes.txt").write_text("caption", encoding="utf-8")
    assert "not an image" in only_skip(scan(tmp_path), "notes.jpg", "not media", caplog)


def test_caption_in_a_bad_encoding(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    image(tmp_path / "data" / "latin.png", caption=None)
    (tmp_path / "data" / "latin.txt").write_bytes("café au lait".encode("latin-1"))
    reason = only_skip(scan(tmp_path), "latin.png", "caption encoding", caplog)
    assert "latin.txt is not UTF-8" in reason and "0xe9" in reason


def test_captions_with_a_byte_order_mark_are_used(tmp_path: Path) -> None:
    image(tmp_path / "data" / "u16.png", caption=None)
    (tmp_path / "data" / "u16.txt").write_bytes("crème brûlée, 日本".encode("utf-16"))  # BOM + UTF-16
    image(tmp_path / "data" / "u8bom.png", caption=None)
    (tmp_path / "data" / "u8bom.txt").write_bytes("naïve".encode("utf-8-sig"))
    result = scan(tmp_path)
    captions = {i.path.name: i.caption for i in result.items}
    assert captions == {"good.png": "ok", "u16.png": "crème brûlée, 日本", "u8bom.png": "naïve"}


def test_mask_of_another_size(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    image(tmp_path / "data" / "masked.png", (64, 64))
    (tmp_path / "masks").mkdir()
    Image.new("L", (32, 64), 255).save(tmp_path / "masks" / "masked.png")
    Image.new("L", (64, 64), 255).save(tmp_path / "masks" / "good.png")
    result = scan(tmp_path)
    reason = only_skip(result, "masked.png", "mask size", caplog)
    assert "32x64" in reason and "64x64" in reason
    good = next(i for i in result.items if i.path.name == "good.png")
    assert good.mask_path == tmp_path / "masks" / "good.png"
    assert "mask" in good.content_key  # editing the mask invalidates the cached latents


def test_file_names_with_spaces_and_non_ascii_are_used(tmp_path: Path) -> None:
    names = ["my photo 1.png", "ça été 写真.jpg", "sub dir/ünïcode näme.webp"]
    for n, name in enumerate(names):
        image(tmp_path / "data" / name, (64 + 16 * n, 64), caption=f"caption {n} ✓", fmt=None)
    (tmp_path / "masks" / "sub dir").mkdir(parents=True)
    Image.new("L", (96, 64), 255).save(tmp_path / "masks" / "sub dir" / "ünïcode näme.png")
    result = scan(tmp_path)
    assert result.skipped == []
    by_id = {i.id: i for i in result.items}
    assert set(by_id) == {"data/good.png", *(f"data/{n}" for n in names)}
    for n, name in enumerate(names):
        it = by_id[f"data/{name}"]
        assert it.caption == f"caption {n} ✓" and it.path == tmp_path / "data" / name
        decoded = load_media(it, IMAGE)
        assert decoded.pixels.shape == (3, it.bucket.height, it.bucket.width)
    assert by_id["data/sub dir/ünïcode näme.webp"].mask_path == tmp_path / "masks" / "sub dir" / "ünïcode näme.png"


def test_video_shorter_than_every_frame_bucket(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    video(tmp_path / "data" / "short.mp4", 6)  # 6 frames at 8 fps; buckets 9 and 17
    reason = only_skip(scan(tmp_path, VIDEO), "short.mp4", "too short", caplog)
    assert "6 frames at 8 fps" in reason and "a video needs at least 9 frames" in reason


def test_a_tiny_image_is_left_out_rather_than_enlarged_64_times(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    image(tmp_path / "data" / "dot.png", (1, 1))
    reason = only_skip(scan(tmp_path), "dot.png", "too small", caplog)
    assert reason == "too small: 1x1 would be enlarged 64x to fill the 64x64 bucket (max_upscale = 8)"
    assert {i.path.name for i in scan(tmp_path, extra="max_upscale = 64.0").items} == {"dot.png", "good.png"}


def test_a_sliver_is_left_out_rather_than_cropped_to_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    image(tmp_path / "data" / "sliver.png", (20000, 20))
    reason = only_skip(scan(tmp_path), "sliver.png", "too cropped", caplog)
    assert reason == "too cropped: the 64x64 bucket would cut away 99.9% of 20000x20 (max_crop = 0.9)"
    assert {i.path.name for i in scan(tmp_path, extra="max_crop = 1.0").items} == {"sliver.png", "good.png"}


def test_missing_directory_is_a_validation_error_before_anything_runs(tmp_path: Path) -> None:
    toml = tmp_path / "dataset.toml"
    toml.write_text('[[directory]]\npath = "data"\n[[directory]]\npath = "no such dir"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"directory\[1\]\.path: directory not found: .*no such dir"):
        load_dataset_config(toml)


def test_an_empty_dataset_says_which_filter_removed_what(tmp_path: Path) -> None:
    (tmp_path / "data" / "good.png").unlink()
    (tmp_path / "data" / "good.txt").unlink()
    image(tmp_path / "data" / "a.png", caption=None)
    image(tmp_path / "data" / "b.png", caption=None)
    (tmp_path / "data" / "z.png").write_bytes(b"")
    with pytest.raises(DatasetError) as info:
        scan(tmp_path)
    text = str(info.value)
    assert "all 3 files" in text and "2 x no caption" in text and "allow_empty_captions" in text
    assert "1 x empty file" in text
