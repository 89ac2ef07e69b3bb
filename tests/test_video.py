"""Acceptance 5: short mp4s written here with PyAV decode to the expected frame count, frames and size,
resampled to the model's frame rate; clip modes; images in video datasets; videos in image datasets."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from diffpipe_core import hookimpl
from diffpipe_core.data.dataset_config import load_dataset_config
from diffpipe_core.data.decode import MediaError, load_media
from diffpipe_core.data.items import Bucket, ScanResult
from diffpipe_core.data.scan import scan_dataset
from diffpipe_core.registry import Registry
from diffpipe_core.testing.media import best_codec
from diffpipe_core.testing.specs import TINY_VIDEO_SPEC
from diffpipe_core.types import ModelConfigBase, ModelSpec


class TinyVideo:
    """An in-process video model plugin: only its spec matters to scanning and decoding."""

    @hookimpl
    def model_spec(self) -> ModelSpec:
        return TINY_VIDEO_SPEC


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    registry = Registry()
    info = registry.register_model("tinyvideo", TinyVideo())
    assert info.ok, info.error
    return registry.model("tinyvideo").spec


def write_video(path: Path, frames: int, fps: int, level, size=(64, 48), options=None, caption="clip") -> Path:
    """Frame i is flat gray at ``level(i)``; that is how the tests tell frames apart after decoding."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", options=options or {}) as container:
        stream = container.add_stream(best_codec(), rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(frames):
            value = level(i)
            arr = value if isinstance(value, np.ndarray) else np.full((size[1], size[0], 3), value, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")))
        container.mux(stream.encode())
    path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def scan(tmp_path: Path, spec: ModelSpec, extra: str = "") -> ScanResult:
    toml = tmp_path / "dataset.toml"
    toml.write_text(
        f"resolutions = [64]\nenable_ar_bucket = true\nframe_buckets = [1, 5, 9, 17, 33]\n{extra}\n"
        '[[directory]]\npath = "data"\n',
        encoding="utf-8",
    )
    return scan_dataset(load_dataset_config(toml), spec)


def levels(pixels: torch.Tensor) -> list[int]:
    """The gray level (0-255) of each frame of a (C, F, H, W) tensor."""
    return [round(float((pixels[:, f].mean() + 1) * 127.5)) for f in range(pixels.shape[1])]


def test_mp4_decodes_to_the_expected_frame_count_and_size(tmp_path: Path, spec: ModelSpec) -> None:
    # 30 frames at 24 fps = 1.25 s -> 10 frames at the model's 8 fps -> frame bucket 9; every 3rd source frame
    write_video(tmp_path / "data" / "clip.mp4", 30, 24, level=lambda i: 8 * i, size=(96, 64))
    result = scan(tmp_path, spec)
    assert result.skipped == []
    (it,) = result.items
    # 96x64 (AR 1.5): the closest of the 7 log-spaced AR buckets at 64^2 is AR 1.587 -> 80x48
    assert it.bucket == Bucket(80, 48, 9) and it.clip_start == 0.0
    out = load_media(it, spec)
    assert out.pixels.shape == (3, 9, 48, 80) and out.pixels.dtype == torch.float32
    assert out.original_size == (64, 96)
    got = levels(out.pixels)
    assert all(abs(g - 24 * k) <= 3 for k, g in enumerate(got)), got
    assert float(out.pixels.min()) >= -1.0 and float(out.pixels.max()) <= 1.0


def test_multiple_overlapping_clips_cover_the_whole_video(tmp_path: Path, spec: ModelSpec) -> None:
    write_video(tmp_path / "data" / "long.mp4", 40, 8, level=lambda i: 6 * i)
    result = scan(tmp_path, spec, 'video_clip_mode = "multiple_overlapping"')
    items = sorted(result.items, key=lambda i: i.clip_start)
    assert [i.id for i in items] == ["data/long.mp4#0", "data/long.mp4#1"]
    assert [i.bucket.frames for i in items] == [33, 33]
    # 40 frames in clips of 33: ceil(40 / 33) = 2 clips, starting at frames 0 and 7
    assert [i.clip_start for i in items] == [0.0, 7 / 8]
    covered = set()
    for it in items:
        start = round(it.clip_start * 8)
        got = levels(load_media(it, spec).pixels)
        assert all(abs(g - 6 * (start + j)) <= 3 for j, g in enumerate(got)), (it.id, got)
        covered |= set(range(start, start + 33))
    assert covered == set(range(40))


def test_clip_modes_with_a_smaller_bucket(tmp_path: Path, spec: ModelSpec) -> None:
    write_video(tmp_path / "data" / "v.mp4", 40, 8, level=lambda i: 6 * i)
    toml_extra = 'frame_buckets = [1, 17]\nvideo_clip_mode = "{}"'
    toml = tmp_path / "dataset.toml"
    starts = {}
    for mode in ("single_beginning", "single_middle", "multiple_overlapping"):
        toml.write_text(f'resolutions = [64]\n{toml_extra.format(mode)}\n[[directory]]\npath = "data"\n')
        starts[mode] = [i.clip_start for i in scan_dataset(load_dataset_config(toml), spec).items]
    assert starts["single_beginning"] == [0.0]
    assert starts["single_middle"] == [11 / 8]
    assert starts["multiple_overlapping"] == [0.0, 12 / 8, 23 / 8]
    toml.write_text(
        'resolutions = [64]\nframe_buckets = [1, 17]\nvideo_clip_mode = "single_middle"\n[[directory]]\npath = "data"\n'
    )
    (it,) = scan_dataset(load_dataset_config(toml), spec).items
    got = levels(load_media(it, spec).pixels)
    assert all(abs(g - 6 * (11 + j)) <= 3 for j, g in enumerate(got)), got


def test_images_in_a_video_dataset_are_one_frame_items(tmp_path: Path, spec: ModelSpec) -> None:
    write_video(tmp_path / "data" / "v.mp4", 20, 8, level=lambda i: 100)
    (tmp_path / "data" / "still.png").parent.mkdir(exist_ok=True)
    Image.new("RGB", (64, 48), (255, 255, 255)).save(tmp_path / "data" / "still.png")
    (tmp_path / "data" / "still.txt").write_text("still", encoding="utf-8")
    items = {i.path.name: i for i in scan(tmp_path, spec).items}
    assert items["still.png"].bucket == Bucket(64, 48, 1) and items["still.png"].clip_start is None
    assert load_media(items["still.png"], spec).pixels.shape == (3, 48, 64)
    assert items["v.mp4"].bucket == Bucket(64, 48, 17)


def test_videos_in_an_image_model_dataset_are_left_out(tmp_path: Path) -> None:
    write_video(tmp_path / "data" / "v.mp4", 20, 8, level=lambda i: 100)
    Image.new("RGB", (64, 48)).save(tmp_path / "data" / "still.png")
    (tmp_path / "data" / "still.txt").write_text("still", encoding="utf-8")
    image_spec = ModelSpec(name="img", modality="image", config_schema=ModelConfigBase)
    result = scan(tmp_path, image_spec)
    assert [i.path.name for i in result.items] == ["still.png"]
    assert [(s.path.name, s.reason) for s in result.skipped] == [("v.mp4", "video: model 'img' trains on images only")]


def test_video_truncated_after_its_header_fails_at_decode_naming_the_file(tmp_path: Path, spec: ModelSpec) -> None:
    rng = np.random.default_rng(0)
    path = write_video(
        tmp_path / "data" / "cut clip.mp4",
        40,
        8,
        size=(128, 96),
        options={"movflags": "faststart"},
        level=lambda i: rng.integers(0, 255, (96, 128, 3), dtype=np.uint8),
    )  # header first
    data = path.read_bytes()
    media_start = data.find(b"mdat")
    assert 0 < data.find(b"moov") < media_start
    path.write_bytes(data[: media_start + (len(data) - media_start) // 3])  # keep the first frames only
    result = scan(tmp_path, spec)
    assert result.skipped == []  # the header is intact, so the scan cannot tell
    (it,) = result.items
    with pytest.raises(MediaError, match=r"cut clip\.mp4.*(ended after|cannot decode)"):
        load_media(it, spec)


def test_resampling_takes_the_source_frame_nearest_each_target_time(tmp_path: Path, spec: ModelSpec) -> None:
    # 10 fps source, 8 fps model: target k at k/8 s; the nearest source frame is round(k * 10 / 8)
    write_video(tmp_path / "data" / "ten.mp4", 20, 10, level=lambda j: 12 * j)
    (it,) = scan(tmp_path, spec).items
    assert it.bucket.frames == 9  # 2 s -> 16 frames at 8 fps -> largest bucket 9
    got = levels(load_media(it, spec).pixels)
    for k, g in enumerate(got):
        exact = k * 10 / 8
        if exact % 1 != 0.5:  # skip ties (equally near two source frames)
            assert abs(g - 12 * round(exact)) <= 3, (k, got)


def test_frame_counts_take_every_frame_time_before_the_end(tmp_path: Path, spec: ModelSpec) -> None:
    """Issue 9.4: frames at k / fps strictly before the end: 26 frames at 24 fps (1.083 s) hold 9 frames at
    8 fps (the last at 1.0 s), not 8; a 1-frame clip holds 1, not 0."""
    from diffpipe_core.data.buckets import resampled_frame_count

    assert resampled_frame_count(26 / 24, 8) == 9 and resampled_frame_count(2.0, 8) == 16
    assert resampled_frame_count(1 / 24, 8) == 1 and resampled_frame_count(0.0, 8) == 0
    write_video(tmp_path / "data" / "c26.mp4", 26, 24, level=lambda j: 9 * j)
    write_video(tmp_path / "data" / "one.mp4", 1, 24, level=lambda j: 100)
    result = scan(tmp_path, spec)
    (item,) = result.items
    assert item.path.name == "c26.mp4" and item.bucket.frames == 9
    got = levels(load_media(item, spec).pixels)
    assert len(got) == 9 and abs(got[-1] - 9 * 24) <= 3, got  # the frame at 1.0 s is source frame 24
    (skipped,) = result.skipped
    assert skipped.path.name == "one.mp4" and skipped.reason.startswith("too short: 1 frame at 8 fps"), skipped
    # issue 20.13: frame_buckets holds 1, so say why that bucket does not take it
    assert skipped.reason.endswith("a video needs at least 5 frames, the smallest video frame bucket (frame bucket "
                                   "1 is for images: save a single frame as an image to train on it)"), skipped
