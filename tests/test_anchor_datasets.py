"""A diffusion-pipe dataset folder as its users have them (issue 43): ``captions.json`` with lists of captions, masks
(and a default mask), control images, media in a ``.tar`` archive; imported with ``diffpipe import-config``, counted
by ``diffpipe data``, pictured by ``diffpipe data --dump``, and cached for training with the same items and every
caption variant. Plus diffusion-pipe's ``size_buckets`` and ``subsample_ratio``.

The model is the reference edit plugin (control images optional, loss masks used), registered in the CLI's registry.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import tomllib
from click.testing import CliRunner
from PIL import Image

import diffpipe_core.registry as registry_module
import diffpipe_reference.edit as edit_plugin
from diffpipe_core import hookimpl
from diffpipe_core.anchor.convert import import_config, write_imported
from diffpipe_core.cli import main
from diffpipe_core.data import prepare_cache
from diffpipe_core.data.dataset_config import load_dataset_config
from diffpipe_core.data.dump import HEADER
from diffpipe_core.data.scan import scan_dataset
from diffpipe_core.registry import Registry
from diffpipe_core.sampling.contact_sheet import cell_size, sheet_layout
from diffpipe_core.testing.cache import rows_by_id
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset, write_png
from diffpipe_core.types import EncodeBatch
from diffpipe_reference.model import write_tiny_model

CAPTIONS = {
    "a.png": ["a red cat", "a cat that is red"],
    "b.png": "a blue dog",
    "c.png": ["green", "verdant", "emerald"],
    "d.png": ["from the archive", "archived"],  # a member of shard.tar, keyed by its name as diffusion-pipe keys it
}
TAR_TXT = {"e.png": "beside it in the archive"}  # webdataset's pairing: e.txt in the same archive
SIZES = {"a.png": (64, 64), "b.png": (64, 64), "c.png": (96, 48), "d.png": (64, 64), "e.png": (48, 96)}
ANCHOR_DATASET = """
resolutions = [64]
enable_ar_bucket = true
min_ar = 0.5
max_ar = 2.0
num_ar_buckets = 3

[[directory]]
path = 'data'
mask_path = 'masks'
default_mask_file = 'default_mask.png'
control_path = 'control'
"""
ANCHOR_RUN = """
output_dir = 'runs'
dataset = 'dataset.toml'
epochs = 1
micro_batch_size_per_gpu = 1
[model]
type = 'reference-edit'
diffusers_path = 'model'
[adapter]
type = 'lora'
rank = 4
"""


class Recorder:
    """A generic plugin recording the captions the cache encodes; the model encodes them."""

    def __init__(self) -> None:
        self.captions: list[str] = []

    @hookimpl(wrapper=True)
    def encode_batch(self, encoders, batch: EncodeBatch):
        self.captions += batch.captions or []
        return (yield)


@pytest.fixture
def edit_registry(monkeypatch: pytest.MonkeyPatch) -> tuple[Registry, Recorder]:
    """The installed models plus the reference edit model, as the CLI sees them."""
    registry = Registry()
    registry.load_entry_points()
    assert registry.register_model("reference-edit", edit_plugin).ok
    recorder = Recorder()
    registry.register_generic("recorder", recorder)
    monkeypatch.setattr(registry_module, "_default", registry)
    return registry, recorder


def _png_bytes(width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _anchor_folder(root: Path) -> Path:
    """diffusion-pipe's dataset layout: media with one captions.json, a .tar of more media, masks for some items, a
    default mask of another size, a control image per item."""
    data = root / "data"
    data.mkdir(parents=True)
    for i, name in enumerate(("a.png", "b.png", "c.png")):
        write_png(data / name, *SIZES[name], seed=i)
    with tarfile.open(data / "shard.tar", "w") as tar:
        members = {"d.png": _png_bytes(*SIZES["d.png"], 3), "e.png": _png_bytes(*SIZES["e.png"], 4),
                   "e.txt": TAR_TXT["e.png"].encode()}
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    (data / "captions.json").write_text(json.dumps(CAPTIONS))
    (root / "masks").mkdir()
    Image.new("L", SIZES["a.png"], 255).save(root / "masks" / "a.png")
    mask = np.zeros((16, 16), np.uint8)
    mask[:, :8] = 255  # the left half trains
    Image.fromarray(mask).save(root / "default_mask.png")
    (root / "control").mkdir()
    for i, name in enumerate(SIZES):
        write_png(root / "control" / name, *SIZES[name], seed=50 + i)
    write_tiny_model(root / "model")
    (root / "dataset.toml").write_text(ANCHOR_DATASET)
    (root / "anchor.toml").write_text(ANCHOR_RUN)
    return root


def test_a_diffusion_pipe_dataset_trains_the_items_diffpipe_data_counts(tmp_path: Path, edit_registry) -> None:
    registry, recorder = edit_registry
    root = _anchor_folder(tmp_path)
    write_imported(import_config(root / "anchor.toml", root), root / "converted")
    data_toml = root / "converted" / "dataset.toml"
    directory = tomllib.loads(data_toml.read_text())["directory"][0]
    assert directory["default_mask_file"] == str(root / "default_mask.png")
    assert directory["control_path"] == str(root / "control")
    run_toml = root / "converted" / "run.toml"

    dump = tmp_path / "dump"
    result = CliRunner().invoke(main, ["data", "--config", str(run_toml), "--dump", str(dump)])
    assert result.exit_code == 0, result.output
    counted = re.search(r"Summary: (\d+) files used, (\d+) items in (\d+) buckets, (\d+) files left out",
                        result.output)
    assert counted is not None, result.output
    assert counted.groups() == ("5", "5", "3", "0"), result.output  # every file, the archive's members too

    spec = registry.model("reference-edit").spec
    scan = scan_dataset(load_dataset_config(data_toml), spec, progress=False)
    items = {item.id: item for item in scan.items}
    assert set(items) == {"a.png", "b.png", "c.png", "shard.tar/d.png", "shard.tar/e.png"}
    assert items["a.png"].caption_variants == tuple(CAPTIONS["a.png"]) and items["b.png"].caption_variants == ()
    assert items["shard.tar/e.png"].caption == TAR_TXT["e.png"]
    assert items["a.png"].mask_path == root / "masks" / "a.png" and not items["a.png"].mask_stretched
    assert all(items[i].mask_path == root / "default_mask.png" and items[i].mask_stretched for i in items
               if i != "a.png")
    assert items["shard.tar/d.png"].controls[0].path == root / "control" / "d.png"

    plugin = registry.model("reference-edit")
    config = plugin.spec.config_schema(type="reference-edit", path=root / "model")
    ds = prepare_cache(data_toml, plugin, config, decode_workers=0, progress=False, batch_size=2)
    assert sorted(rows_by_id(ds)) == sorted(items)  # what training reads: the items diffpipe data counted
    every_caption = {c for v in CAPTIONS.values() for c in ([v] if isinstance(v, str) else v)} | set(TAR_TXT.values())
    assert every_caption <= set(recorder.captions)  # each caption variant reached the cache
    masks = {k: v["mask"] for k, v in rows_by_id(ds).items()}
    left, right = masks["shard.tar/d.png"][0].chunk(2, dim=-1)  # the default mask stretched: its left half trains
    assert left.min() > 0.8 and right.max() < 0.2


def test_dump_writes_one_image_per_item_and_one_sheet_per_bucket(tmp_path: Path, edit_registry) -> None:
    registry, _ = edit_registry
    root = _anchor_folder(tmp_path)
    write_imported(import_config(root / "anchor.toml", root), root / "converted")
    run_toml = root / "converted" / "run.toml"
    dump = tmp_path / "dump"
    result = CliRunner().invoke(main, ["data", "--config", str(run_toml), "--dump", str(dump)])
    assert result.exit_code == 0, result.output
    assert f"diffpipe: wrote 5 item images to {dump / 'items'} and 3 bucket contact sheets" in result.output
    scan = scan_dataset(load_dataset_config(root / "converted" / "dataset.toml"),
                        registry.model("reference-edit").spec, progress=False)
    images = sorted((dump / "items").rglob("*.png"))
    assert len(images) == len(scan.items) == 5
    for item in scan.items:
        (image,) = [p for p in images if p.parent.name == str(item.bucket) and p.name.endswith(
            re.sub(r"[^A-Za-z0-9._#@-]+", "_", item.id) + ".png")]
        with Image.open(image) as im:  # the item, its mask and its control image, each at the bucket's size
            assert im.size == (3 * item.bucket.width, item.bucket.height), item.id
            trained = np.asarray(im)[:, : item.bucket.width]
            mask = np.asarray(im)[:, item.bucket.width : 2 * item.bucket.width, 0]
        if item.mask_stretched:
            assert mask[:, : item.bucket.width // 4].min() > 200 and mask[:, -item.bucket.width // 4 :].max() < 50
        assert trained.std() > 10  # a picture, not a blank panel
    buckets: dict = {}
    for item in scan.items:
        buckets[item.bucket] = buckets.get(item.bucket, 0) + 1
    sheets = sorted((dump / "sheets").glob("*.png"))
    assert [p.stem for p in sheets] == sorted(str(b) for b in buckets)
    for bucket, n in buckets.items():  # the sampling contact sheet's grid of the bucket's n items, under its counts
        width, height = sheet_layout(n, cell_size(bucket.width, bucket.height)).size
        with Image.open(dump / "sheets" / f"{bucket}.png") as sheet:
            assert sheet.size == (width, height + HEADER), bucket
    again = CliRunner().invoke(main, ["data", "--config", str(run_toml), "--dump", str(dump)])
    assert again.exit_code == 1 and f"--dump {dump}: is not empty" in again.output  # before any work


def test_size_buckets_and_subsample_ratio(tmp_path: Path) -> None:
    """diffusion-pipe's size_buckets: each item takes the listed size of the nearest aspect ratio, once; its
    subsample_ratio keeps the same share of the items on every scan."""
    spec = edit_plugin.EDIT_SPEC
    sizes = [(64, 64), (96, 48), (48, 96), (100, 40), (64, 64), (96, 48)]
    write_image_dataset(tmp_path / "data", 6, size=sizes)
    toml = write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "data",
                              size_buckets=[[64, 64, 1], [96, 48, 1], [40, 88]])
    scan = scan_dataset(load_dataset_config(toml), spec, progress=False)
    got = {item.path.name: (item.bucket.width, item.bucket.height) for item in scan.items}
    # [40, 88] rounds down to the reference model's multiple of 16
    assert got == {"img_000.png": (64, 64), "img_001.png": (96, 48), "img_002.png": (32, 80),
                   "img_003.png": (96, 48), "img_004.png": (64, 64), "img_005.png": (96, 48)}
    toml.write_text("subsample_ratio = 0.5\n" + toml.read_text())
    first = [item.id for item in scan_dataset(load_dataset_config(toml), spec, progress=False).items]
    second = [item.id for item in scan_dataset(load_dataset_config(toml), spec, progress=False).items]
    assert len(first) == 3 and first == second


def test_videos_in_a_tar_archive_take_size_buckets_by_frames(tmp_path: Path) -> None:
    """A clip inside a .tar is probed, bucketed by size_buckets (the size of its aspect ratio among those with the
    most frames it fills) and decoded from the archive; an image of the same dataset takes the 1-frame size."""
    from diffpipe_core.data.cache_keys import file_content_key
    from diffpipe_core.data.decode import load_media
    from diffpipe_core.schema import ConfigError
    from diffpipe_core.testing.media import write_video
    from diffpipe_core.testing.specs import TINY_VIDEO_SPEC

    data = tmp_path / "data"
    write_image_dataset(data, 1, size=(96, 48))
    clip = write_video(tmp_path / "clip.mp4", frames=40, fps=16, size=(64, 64))  # 2.5 s: 20 frames at 8 fps
    with tarfile.open(data / "clips.tar", "w") as tar:
        tar.add(clip, arcname="clip.mp4")
        info = tarfile.TarInfo("clip.txt")
        info.size = len(b"a clip")
        tar.addfile(info, io.BytesIO(b"a clip"))
    (data / "broken.tar").write_bytes(b"not an archive" * 100)
    toml = write_dataset_toml(tmp_path / "dataset.toml", data,
                              size_buckets=[[96, 48, 1], [64, 64, 9], [64, 64, 17], [96, 48, 33]])
    scan = scan_dataset(load_dataset_config(toml), TINY_VIDEO_SPEC, progress=False)
    items = {item.id: item for item in scan.items}
    assert set(items) == {"data/img_000.png", "data/clips.tar/clip.mp4"}
    (skipped,) = scan.skipped  # named, with why, and the rest of the dataset still scanned
    assert skipped.path == data / "broken.tar" and skipped.reason.startswith("unreadable: not a readable .tar")
    video = items["data/clips.tar/clip.mp4"]
    assert (video.bucket.width, video.bucket.height, video.bucket.frames) == (64, 64, 17)
    assert video.caption == "a clip" and items["data/img_000.png"].bucket.frames == 1
    assert load_media(video, TINY_VIDEO_SPEC).pixels.shape == (3, 17, 64, 64)
    assert file_content_key(video.path, strict=True) == file_content_key(clip, strict=True)  # --strict: its bytes

    toml.write_text(toml.read_text().replace("[64, 64, 17]", "[64, 64, 16]"))
    with pytest.raises(ConfigError) as err:  # frame counts the model cannot take: named by the key they came from
        scan_dataset(load_dataset_config(toml), TINY_VIDEO_SPEC, progress=False)
    assert "size_buckets: 16 frames does not fit model 'tinyvideo'" in str(err.value)
