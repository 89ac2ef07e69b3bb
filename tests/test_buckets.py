"""Acceptance 1: images of several aspect ratios land in the expected buckets, sizes rounded down to the
plugin's multiple; videos land in the largest frame bucket they fill. Plus the report's arithmetic."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from diffpipe_core.data.buckets import clip_starts, round_size, spatial_buckets
from diffpipe_core.data.dataset_config import load_dataset_config
from diffpipe_core.data.items import Bucket, MediaItem, ScanResult, SkippedFile
from diffpipe_core.data.report import format_report
from diffpipe_core.data.scan import scan_dataset
from diffpipe_core.registry import get_registry
from diffpipe_core.schema import ConfigError
from diffpipe_core.testing.specs import TINY_VIDEO_SPEC
from diffpipe_core.types import ModelConfigBase, ModelSpec

VIDEO = TINY_VIDEO_SPEC


def reference_spec() -> ModelSpec:
    return get_registry().model("reference").spec  # the installed reference plugin: spatial_multiple=16


def image(path: Path, size: tuple[int, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (10, 200, 90)).save(path)
    path.with_suffix(".txt").write_text("caption", encoding="utf-8")


def video(path: Path, frames: int, fps: int = 8, size: tuple[int, int] = (64, 48)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), i % 256, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    path.with_suffix(".txt").write_text("a clip", encoding="utf-8")


def dataset(tmp_path: Path, body: str) -> Path:
    toml = tmp_path / "dataset.toml"
    toml.write_text(body + '\n[[directory]]\npath = "data"\n', encoding="utf-8")
    return toml


def test_round_size_keeps_area_and_rounds_down_to_the_multiple() -> None:
    assert round_size(512 * 512, 1.0, 16) == (512, 512)
    assert round_size(512 * 512, 2.0, 16) == (720, 352)  # 724.1 x 362.0 rounded down
    assert round_size(512 * 512, 0.5, 16) == (352, 720)
    assert round_size(512 * 512, 2.0, 64) == (704, 320)
    w, h = round_size(1024 * 1024, 16 / 9, 16)
    assert (w % 16, h % 16) == (0, 0) and 0.95 < w * h / 1024**2 <= 1.0


def test_images_of_several_aspect_ratios_land_in_the_expected_buckets(tmp_path: Path) -> None:
    data = tmp_path / "data"
    sizes = {
        "square.png": (300, 300),
        "wide.png": (800, 400),
        "tall.png": (400, 800),
        "four_three.png": (640, 480),
        "slightly_wide.png": (520, 500),
        "too_wide.png": (900, 300),
    }
    for name, size in sizes.items():
        image(data / name, size)
    toml = dataset(tmp_path, "resolutions = [512]\nenable_ar_bucket = true\nnum_ar_buckets = 5\n")
    scan = scan_dataset(load_dataset_config(toml), reference_spec())
    buckets = {item.path.name: item.bucket for item in scan.items}
    # log-spaced ARs 0.5, 0.707, 1, 1.414, 2 at area 512^2, rounded down to 16
    assert buckets == {
        "square.png": Bucket(512, 512),
        "slightly_wide.png": Bucket(512, 512),
        "wide.png": Bucket(720, 352),
        "tall.png": Bucket(352, 720),
        "four_three.png": Bucket(608, 416),  # closest AR is sqrt(2): 608.9 x 430.5 -> 608 x 416
        # issue 9.5: outside max_ar = 2 it goes to the nearest bucket, as in diffusion-pipe, cropped
        "too_wide.png": Bucket(720, 352),
    }
    assert scan.skipped == []
    for b in buckets.values():
        assert b.width % 16 == 0 and b.height % 16 == 0 and b.frames == 1
    crops = {item.path.name: item.crop_fraction for item in scan.items}
    assert crops["too_wide.png"] == pytest.approx(1 - (720 / 352) / 3) and crops["square.png"] == 0
    report = format_report(scan, 1, 1)
    assert "1 item cropped by more than 20% of the image to fit its bucket (most: data/too_wide.png, 32%)" in report
    assert "6 files used, 6 items in 4 buckets, 0 files left out" in report

    keys = "resolutions = [512]\nenable_ar_bucket = true\nnum_ar_buckets = 5\ndrop_outside_ar = true\n"
    toml = dataset(tmp_path, keys)
    scan = scan_dataset(load_dataset_config(toml), reference_spec())
    assert [(s.path.name, s.reason.split(":")[0]) for s in scan.skipped] == [("too_wide.png", "aspect ratio")]
    assert "cropped by more than" not in format_report(scan, 1, 1)


def test_explicit_ar_buckets_multiple_resolutions_and_a_coarser_multiple(tmp_path: Path) -> None:
    image(tmp_path / "data" / "pic.png", (640, 480))
    toml = dataset(tmp_path, "resolutions = [256, [512, 512]]\nenable_ar_bucket = true\nar_buckets = [[4, 3], 1.0]\n")
    spec = ModelSpec(name="coarse", modality="image", config_schema=ModelConfigBase, spatial_multiple=64)
    scan = scan_dataset(load_dataset_config(toml), spec)
    # 256^2 at 4:3 -> 295.6 x 221.7 -> 256 x 192; 512^2 at 4:3 -> 591.2 x 443.4 -> 576 x 384
    assert sorted((i.id, i.bucket) for i in scan.items) == [
        ("data/pic.png@256x192", Bucket(256, 192)),
        ("data/pic.png@576x384", Bucket(576, 384)),
    ]


def test_without_ar_bucketing_everything_is_one_shape(tmp_path: Path) -> None:
    image(tmp_path / "data" / "wide.png", (900, 300))
    image(tmp_path / "data" / "tall.png", (200, 500))
    toml = dataset(tmp_path, "resolutions = [[200, 120]]\n")
    scan = scan_dataset(load_dataset_config(toml), reference_spec())
    assert {i.bucket for i in scan.items} == {Bucket(192, 112)}  # exactly [w, h], rounded down to 16
    assert scan.skipped == []


def test_spatial_buckets_are_distinct_and_sorted(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    toml = dataset(tmp_path, "enable_ar_bucket = true\nnum_ar_buckets = 9\nmin_ar = 0.9\nmax_ar = 1.1\n")
    s = load_dataset_config(toml).settings_for(0)
    buckets = spatial_buckets(64, s, 16)
    assert len(buckets) == len(set(buckets))
    assert list(buckets) == sorted(buckets, key=lambda b: b.width / b.height)


def test_videos_land_in_the_largest_frame_bucket_they_fill(tmp_path: Path) -> None:
    data = tmp_path / "data"
    video(data / "v10.mp4", 10)  # 10 frames at 8 fps
    video(data / "v17.mp4", 17)
    video(data / "v40.mp4", 40)
    video(data / "v24fps.mp4", 30, fps=24)  # 1.25 s -> 10 frames at the model's 8 fps
    image(data / "still.png", (64, 48))
    toml = dataset(tmp_path, "resolutions = [64]\nenable_ar_bucket = true\nframe_buckets = [1, 5, 9, 17, 33]\n")
    scan = scan_dataset(load_dataset_config(toml), VIDEO)
    frames = {item.path.name: item.bucket.frames for item in scan.items}
    assert frames == {"v10.mp4": 9, "v17.mp4": 17, "v40.mp4": 33, "v24fps.mp4": 9, "still.png": 1}
    spatial = {(i.bucket.width, i.bucket.height) for i in scan.items}
    assert spatial == {(64, 48)}
    assert all(i.clip_start == 0.0 for i in scan.items if i.path.suffix == ".mp4")
    assert next(i for i in scan.items if i.path.suffix == ".png").clip_start is None


def test_frame_buckets_that_do_not_fit_the_model_are_a_config_error(tmp_path: Path) -> None:
    video(tmp_path / "data" / "v.mp4", 20)
    toml = dataset(tmp_path, "frame_buckets = [1, 16, 17]\n")
    with pytest.raises(ConfigError, match=r"frame_buckets: 16 frames does not fit model 'tinyvideo'.*13 or 17"):
        scan_dataset(load_dataset_config(toml), VIDEO)


def test_clip_starts_cover_the_whole_video() -> None:
    assert clip_starts(40, 17, "single_beginning") == [0]
    assert clip_starts(40, 17, "single_middle") == [11]
    starts = clip_starts(40, 17, "multiple_overlapping")
    assert starts[0] == 0 and starts[-1] + 17 == 40 and len(starts) == 3
    assert all(b - a <= 17 for a, b in zip(starts, starts[1:]))  # no gaps
    assert clip_starts(17, 17, "multiple_overlapping") == [0]
    assert clip_starts(10, 17, "single_beginning") == []


def test_report_counts_repeats_batches_per_rank_and_remainders() -> None:
    def item(i: int, bucket: Bucket, repeats: int = 1) -> MediaItem:
        return MediaItem(f"f{i}.png", Path(f"/d/f{i}.png"), "c", bucket, "k", repeats=repeats)

    a, b = Bucket(512, 512), Bucket(720, 352, 33)
    scan = ScanResult(
        items=[item(i, a) for i in range(7)] + [item(10, b, repeats=3), item(11, b, repeats=3)],
        skipped=[
            SkippedFile(Path("/d/bad.png"), "unreadable: truncated"),
            SkippedFile(Path("/d/x.mp4"), "too short: 4 frames at 8 fps (0.50s)"),
        ],
    )
    text = format_report(scan, micro_batch_size=2, dp_world_size=2)
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line[:1].isdigit()}
    assert rows["512x512"] == ["1", "7", "1", "3"]  # 7 samples, 4 per global micro-batch -> 1 each, 3 left
    assert rows["720x352"] == ["33", "6", "1", "2"]  # 2 items x 3 repeats
    assert "/d/bad.png" in text and "unreadable: truncated" in text and "/d/x.mp4" in text
    assert "9 files used" in text and "2 files left out (1 unreadable, 1 too short)" in text


def test_resolutions_that_round_to_the_same_size_give_one_item(tmp_path: Path) -> None:
    image(tmp_path / "data" / "pic.png", (300, 300))
    toml = dataset(tmp_path, "resolutions = [512, 520, 256]\n")
    scan = scan_dataset(load_dataset_config(toml), reference_spec())
    assert sorted((i.id, i.bucket) for i in scan.items) == [
        ("data/pic.png@256x256", Bucket(256, 256)),
        ("data/pic.png@512x512", Bucket(512, 512)),
    ]
