"""Issue 15, tests 1-3: the scan index beside the cache.

Decodes are counted by wrapping the real probes (``decode.probe_image`` / ``probe_video``) and the caption
reader: the index must make a re-scan of unchanged files read none of them, re-read exactly the changed
ones, and never trust an index that is corrupt or from another version.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffpipe_core.data import captions, decode, scan_index
from diffpipe_core.data.dataset_config import DatasetConfig, load_dataset_config
from diffpipe_core.data.items import ScanResult
from diffpipe_core.data.scan import scan_dataset
from diffpipe_core.testing.media import write_dataset_toml
from diffpipe_core.types import ModelConfigBase, ModelSpec

SPEC = ModelSpec(name="img", modality="image", config_schema=ModelConfigBase, spatial_multiple=16)


def _image(path: Path, size: tuple[int, int], caption: str | None = "a caption", fmt: str | None = None) -> Path:
    arr = (np.arange(size[0] * size[1] * 3) % 251).astype(np.uint8).reshape(size[1], size[0], 3)
    Image.fromarray(arr).save(path, format=fmt)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts every real image/video probe and caption read, by path name."""
    counts: Counter = Counter()

    def counting(fn):
        def wrapper(path, *args, **kwargs):
            counts[Path(path).name] += 1
            return fn(path, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(decode, "probe_image", counting(decode.probe_image))
    monkeypatch.setattr(decode, "probe_video", counting(decode.probe_video))
    monkeypatch.setattr(captions, "read_caption", counting(captions.read_caption))
    return counts


def _dataset(tmp_path: Path, sizes: list[tuple[int, int]]) -> DatasetConfig:
    data = tmp_path / "data"
    data.mkdir()
    for i, size in enumerate(sizes):
        _image(data / f"img_{i}.png", size, caption=f"caption {i}")
    return _config(tmp_path, data)


def _config(tmp_path: Path, data: Path) -> DatasetConfig:
    toml = write_dataset_toml(tmp_path / "dataset.toml", data, resolutions=[64], enable_ar_bucket=True,
                              num_ar_buckets=5)
    return load_dataset_config(toml)


def _index_file(cfg: DatasetConfig) -> Path:
    (found,) = (cfg.cache_dir / "scan").glob("*.json")
    return found


def _by_name(result: ScanResult) -> dict[str, tuple]:
    return {i.path.name: (i.bucket, i.caption, i.content_key) for i in result.items}


def test_second_scan_of_unchanged_folder_reads_no_file(tmp_path: Path, reads: Counter) -> None:
    cfg = _dataset(tmp_path, [(64, 64), (96, 64), (64, 96), (80, 64)])
    first = scan_dataset(cfg, SPEC)
    assert sum(reads.values()) == 8  # 4 images probed, 4 captions read
    assert first.stats["read"] == 8 and first.stats["reused"] == 0
    assert _index_file(cfg).is_file()

    reads.clear()
    second = scan_dataset(cfg, SPEC)
    assert sum(reads.values()) == 0, f"unchanged files were read again: {dict(reads)}"
    assert second.stats["read"] == 0 and second.stats["reused"] == 8
    assert _by_name(second) == _by_name(first)
    assert [s.path for s in second.skipped] == [s.path for s in first.skipped]


def test_changed_and_removed_files_are_reread_or_dropped(tmp_path: Path, reads: Counter) -> None:
    data = tmp_path / "data"
    data.mkdir()
    # BMP size depends only on the pixel count: 48x32 and 32x48 files have the same number of bytes
    turned = _image(data / "turned.bmp", (48, 32), fmt="BMP")
    grown = _image(data / "grown.png", (64, 64))
    recaptioned = _image(data / "recaptioned.png", (64, 64), caption="old words")
    gone = _image(data / "gone.png", (64, 64))
    _image(data / "same.png", (64, 64))
    cfg = _config(tmp_path, data)
    before = _by_name(scan_dataset(cfg, SPEC))
    assert before["turned.bmp"][0].width > before["turned.bmp"][0].height

    # same size, new mtime: another picture
    size, st = turned.stat().st_size, turned.stat()
    _image(turned, (32, 48), caption=None, fmt="BMP")
    assert turned.stat().st_size == size
    os.utime(turned, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    # new size, old mtime: only the size tells
    st = grown.stat()
    _image(grown, (96, 48), caption=None)
    assert grown.stat().st_size != st.st_size
    os.utime(grown, ns=(st.st_atime_ns, st.st_mtime_ns))
    # a caption of the same length, rewritten later
    txt = recaptioned.with_suffix(".txt")
    st = txt.stat()
    txt.write_text("new words", encoding="utf-8")
    os.utime(txt, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    gone.unlink()
    gone.with_suffix(".txt").unlink()

    reads.clear()
    result = scan_dataset(cfg, SPEC)
    after = _by_name(result)
    assert dict(reads) == {"turned.bmp": 1, "grown.png": 1, "recaptioned.txt": 1}
    assert after["turned.bmp"][0].width < after["turned.bmp"][0].height  # its bucket follows the new picture
    assert after["turned.bmp"][2] != before["turned.bmp"][2]
    assert after["grown.png"][0].width > after["grown.png"][0].height
    assert after["recaptioned.png"][1] == "new words"
    assert "gone.png" not in after and after["same.png"] == before["same.png"]
    assert result.stats["removed"] == 2  # gone.png and gone.txt left the index
    folders = json.loads(_index_file(cfg).read_text())["folders"]
    assert not any(Path(name).stem == "gone" for files in folders.values() for name in files)

    # a file that became unreadable is left out, and its new state is remembered
    turned.write_bytes(b"not an image any more")
    reads.clear()
    result = scan_dataset(cfg, SPEC)
    assert [s.path.name for s in result.skipped] == ["turned.bmp"] and reads["turned.bmp"] == 1
    reads.clear()
    again = scan_dataset(cfg, SPEC)
    assert [(s.path.name, s.reason) for s in again.skipped] == [(s.path.name, s.reason) for s in result.skipped]
    assert sum(reads.values()) == 0


def _wrong_facts(index_file: Path) -> dict:
    """The index with every image's width and height swapped: if any of it were trusted, buckets would flip."""
    data = json.loads(index_file.read_text())
    for files in data["folders"].values():
        for entry in files.values():
            if entry[3] == "i":
                entry[4], entry[5] = entry[5], entry[4]
    return data


@pytest.mark.parametrize(
    ("damage", "warning"),
    [
        (lambda data: b'{"format": 1, "folders": {"/x": {"y.png": [1, 2', "corrupt"),
        (lambda data: json.dumps({**data, "format": 999}).encode(), "another version"),
        (lambda data: json.dumps({**data, "diffpipe": "0.0.1"}).encode(), "another version"),
        (lambda data: json.dumps({**data, "folders": {**data["folders"], "/x": {"y.png": ["big", 1, None, "i", 1, 1]}}})
         .encode(), "corrupt"),
        (lambda data: json.dumps({**data, "folders": {**data["folders"], "/x": {"y.png": [9, 1, None, "i", 1, "1"]}}})
         .encode(), "corrupt"),
        (lambda data: json.dumps({**data, "folders": {**data["folders"], "/x": {"y.png": [9, 1, None, ["i"]]}}})
         .encode(), "corrupt"),
        (lambda data: json.dumps([data]).encode(), "corrupt"),
    ],
    ids=["truncated", "other-format", "other-diffpipe", "bad-size", "bad-fact", "bad-kind", "not-a-table"],
)
def test_corrupt_or_foreign_index_is_rebuilt_with_a_warning(tmp_path: Path, reads: Counter, caplog, damage,
                                                            warning: str) -> None:
    cfg = _dataset(tmp_path, [(96, 64), (64, 96), (64, 64)])
    truth = _by_name(scan_dataset(cfg, SPEC))
    index_file = _index_file(cfg)
    index_file.write_bytes(damage(_wrong_facts(index_file)))

    reads.clear()
    with caplog.at_level(logging.WARNING, logger="diffpipe.data"):
        result = scan_dataset(cfg, SPEC)
    assert any(warning in r.getMessage() and str(index_file) in r.getMessage() for r in caplog.records), caplog.text
    assert sum(reads.values()) == 6  # nothing in it was trusted: every image and caption read again
    assert _by_name(result) == truth

    reads.clear()
    caplog.clear()
    assert _by_name(scan_dataset(cfg, SPEC)) == truth  # rebuilt: the next scan uses it
    assert sum(reads.values()) == 0 and not caplog.records


def test_first_scan_in_a_process_pool_matches_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         reads: Counter) -> None:
    sizes = [(64, 64), (96, 64), (64, 96), (80, 64), (64, 80), (48, 96)]
    cfg = _dataset(tmp_path, sizes)
    (cfg.source.parent / "data" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    serial = scan_dataset(cfg, SPEC, workers=1)
    _index_file(cfg).unlink()
    monkeypatch.setattr(scan_index, "POOL_MIN_FILES", 1)
    reads.clear()
    pooled = scan_dataset(cfg, SPEC, workers=2)
    assert pooled.stats["read"] == 2 * len(sizes) + 1
    assert sum(reads.values()) == 0  # read by the pool's processes, not by this one (whose probes are counted)
    assert _by_name(pooled) == _by_name(serial)
    assert [(s.path, s.reason) for s in pooled.skipped] == [(s.path, s.reason) for s in serial.skipped]


def test_strict_also_checks_content_when_size_and_mtime_match(tmp_path: Path, reads: Counter) -> None:
    data = tmp_path / "data"
    data.mkdir()
    turned = _image(data / "turned.bmp", (48, 32), fmt="BMP")
    cfg = _config(tmp_path, data)
    scan_dataset(cfg, SPEC, strict=True)
    st = turned.stat()
    _image(turned, (32, 48), caption=None, fmt="BMP")  # another picture, same size, and the old mtime restored
    os.utime(turned, ns=(st.st_atime_ns, st.st_mtime_ns))

    reads.clear()
    (item,) = scan_dataset(cfg, SPEC, strict=True).items
    assert reads["turned.bmp"] == 1 and item.bucket.width < item.bucket.height
    assert item.content_key.startswith("sha256:")
    reads.clear()
    assert scan_dataset(cfg, SPEC, strict=True).items == [item] and sum(reads.values()) == 0
