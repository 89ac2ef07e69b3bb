"""Issue 19, the data path of conditioned training: edit pairs (``[[directory]] control_path``) and image-to-video
(``ModelSpec.first_frame``), and the shared first-frame conditioning of the flow-matching maths.

Test 1: a dataset with pairs, a missing control, an undecodable control and a control of another aspect ratio
(what is kept, what is left out and why, the crop pixel-wise). Test 2: one changed control image re-encodes that
control latent and nothing else. Test 5 (in-process half): a first-frame video plugin receives each clip's decoded
first frame, what it returns is cached with the clip, and an image in its dataset is refused naming the file; the
training runs are in ``test_conditioning_train.py``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import diffpipe_reference.edit as edit_plugin
import diffpipe_reference.i2v as i2v_plugin
import diffpipe_reference.plugin as reference_plugin
from diffpipe_core import hookimpl
from diffpipe_core.data import prepare_cache
from diffpipe_core.data.cache_encode import control_work
from diffpipe_core.data.dataset_config import load_dataset_config
from diffpipe_core.data.decode import load_media
from diffpipe_core.data.items import Bucket
from diffpipe_core.data.report import format_report
from diffpipe_core.data.scan import DatasetError, scan_dataset
from diffpipe_core.diffusion import first_frame_conditioning, flow_matching_pair, sample_timesteps
from diffpipe_core.registry import Registry
from diffpipe_core.schema import ConfigError
from diffpipe_core.testing.cache import rows_by_id
from diffpipe_core.testing.media import write_png, write_video
from diffpipe_core.types import EncodeBatch, control_key
from diffpipe_reference.model import write_tiny_model


class Recorder:
    """A generic plugin wrapping the model's encode_batch: records what every batch held; the model encodes."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.batches: list[EncodeBatch] = []

    def media(self) -> list[EncodeBatch]:
        return [b for b in self.batches if b.pixels is not None and b.control_index is None]

    def controls(self) -> list[EncodeBatch]:
        return [b for b in self.batches if b.control_index is not None]

    def captions(self) -> list[str]:
        return [c for b in self.batches if b.captions is not None for c in b.captions]

    @hookimpl(wrapper=True)
    def encode_batch(self, encoders, batch: EncodeBatch):
        self.batches.append(batch)
        return (yield)


class SpecVariant:
    """The edit plugin with other ``ModelSpec`` conditioning fields (in-process only)."""

    def __init__(self, **changes) -> None:
        self.spec = dataclasses.replace(edit_plugin.EDIT_SPEC, **changes)

    @hookimpl
    def model_spec(self):
        return self.spec

    @hookimpl
    def load_encoders(self, model_config, device):
        return edit_plugin.load_encoders(model_config, device)

    @hookimpl
    def encode_batch(self, encoders, batch):
        return edit_plugin.encode_batch(encoders, batch)


def registered(name: str, plugin_obj: object) -> tuple:
    registry = Registry()
    info = registry.register_model(name, plugin_obj)
    assert info.ok, info.error
    recorder = Recorder()
    registry.register_generic("recorder", recorder)
    return registry.model(name), recorder


def stripes(path: Path, width: int, height: int) -> Path:
    """Vertical thirds red | green | blue: where a crop takes its columns from is visible in the pixels."""
    arr = np.zeros((height, width, 3), np.uint8)
    third = width // 3
    arr[:, :third, 0] = 255
    arr[:, third : 2 * third, 1] = 255
    arr[:, 2 * third :, 2] = 255
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)
    return path


def target(root: Path, rel: str, size=(64, 64), seed: int = 0, caption: str | None = None) -> Path:
    path = root / "data" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    write_png(path, *size, seed=seed)
    path.with_suffix(".txt").write_text(caption or f"edit {path.stem}", encoding="utf-8")
    return path


def control(root: Path, rel: str, size=(64, 64), seed: int = 100, folder: str = "control") -> Path:
    path = root / folder / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jpg":
        Image.open(write_png(path.with_suffix(".png"), *size, seed=seed)).save(path, quality=95)
        path.with_suffix(".png").unlink()
    else:
        write_png(path, *size, seed=seed)
    return path


def toml(root: Path, directories: str, top: str = "resolutions = [64]\n") -> Path:
    path = root / "dataset.toml"
    path.write_text(top + directories, encoding="utf-8")
    return path


def touch_later(path: Path) -> None:
    st = path.stat()  # a coarse-mtime filesystem must still see the change
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def cover_and_center_crop(path: Path, width: int, height: int) -> np.ndarray:
    """The reference crop, computed independently: resize to cover (width, height) keeping the aspect ratio, then
    cut the center."""
    with Image.open(path) as im:
        im = im.convert("RGB")
        scale = max(width / im.width, height / im.height)
        rw, rh = max(width, round(im.width * scale)), max(height, round(im.height * scale))
        resized = im.resize((rw, rh), Image.Resampling.LANCZOS)
        left, top = (rw - width) // 2, (rh - height) // 2
        return np.asarray(resized.crop((left, top, left + width, top + height)), dtype=np.int16)


def as_uint8(pixels: torch.Tensor) -> np.ndarray:
    return ((pixels.permute(1, 2, 0).numpy() + 1) * 127.5).round().astype(np.int16)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "model")


def _cache(dataset: Path, plugin, config, **kw):
    return prepare_cache(dataset, plugin, config, **{"decode_workers": 0, "progress": False, "batch_size": 2, **kw})


# ------------------------------------------------------------------------------------------------- test 1
def test_edit_pairs_what_is_kept_what_is_left_out_and_the_control_crop(tmp_path: Path, model_dir: Path,
                                                                        caplog) -> None:
    target(tmp_path, "pair.png", seed=1)
    control(tmp_path, "pair.png")
    target(tmp_path, "sub/nested.png", seed=2)
    control(tmp_path, "sub/nested.jpg")  # same relative path and stem, another extension
    missing = target(tmp_path, "missing.png", seed=3)  # no control image
    broken = target(tmp_path, "broken.png", seed=4)
    bad = control(tmp_path, "broken.png")
    bad.write_bytes(bad.read_bytes()[:80])  # truncated: cannot be decoded
    target(tmp_path, "wide.png", seed=5)
    wide = stripes(tmp_path / "control" / "wide.png", 96, 48)  # another aspect ratio than its 64x64 target
    control(tmp_path, "nobody.png")  # a control without a target: ignored
    dataset = toml(tmp_path, '[[directory]]\npath = "data"\ncontrol_path = "control"\n')
    plugin, recorder = registered("reference-edit", edit_plugin)

    with caplog.at_level("WARNING", logger="diffpipe.data"):
        scan = scan_dataset(load_dataset_config(dataset), plugin.spec)
    kept = {item.id: item for item in scan.items}
    assert sorted(kept) == ["data/pair.png", "data/sub/nested.png", "data/wide.png"]
    assert kept["data/sub/nested.png"].controls[0].path == tmp_path / "control" / "sub" / "nested.jpg"
    for item in kept.values():  # buckets follow the target; each control is decoded at the target's bucket
        assert item.bucket == Bucket(64, 64) and [c.bucket for c in item.controls] == [Bucket(64, 64)]
    why = {s.path: s.reason for s in scan.skipped}
    assert sorted(why) == [broken, missing]
    assert why[missing] == (f"no control image: {tmp_path / 'control' / 'missing'}.<image extension> not found "
                            "(directory[0].control_path)")
    assert why[broken].startswith(f"unreadable control: {bad}: corrupt or truncated image")
    warnings = [r.getMessage() for r in caplog.records]
    for target_file, control_file in ((missing, tmp_path / "control" / "missing"), (broken, bad)):
        assert any(str(target_file) in w and str(control_file) in w for w in warnings), warnings
    report = format_report(scan, 1, 1)  # what `diffpipe data` prints
    lines = report.splitlines()
    assert any(line.startswith(str(missing)) and "no control image" in line for line in lines), report
    assert any(line.startswith(str(broken)) and f"unreadable control: {bad}" in line for line in lines), report
    assert "control images" in report.splitlines()[1] and "Edit pairs: 3 items with control images" in report

    # The control of another aspect ratio is resized to cover the target's bucket and center-cropped, pixel-wise:
    # 96x48 -> 128x64 (thirds at columns 42.7 and 85.3) -> columns 32..95: 11 red, 42 green, 11 blue.
    config = plugin.spec.config_schema(type="reference-edit", path=model_dir)
    ds = _cache(dataset, plugin, config)
    assert len(ds) == 3 and ds.summary["encoded_controls"] == 3 and ds.summary["skipped"] == 2
    assert sum(len(b.pixels) for b in recorder.controls()) == 3 and not recorder.media()[0].control_index
    assert all(b.masks is None and b.pixels.shape[1:] == (3, 64, 64) for b in recorder.controls())
    decoded = load_media(control_work("", kept["data/wide.png"], 0).item, plugin.spec).pixels
    assert any(torch.equal(decoded, px) for b in recorder.controls() for px in b.pixels)  # what was encoded
    got = as_uint8(decoded)
    assert np.abs(got - cover_and_center_crop(wide, 64, 64)).max() <= 1
    assert (got[:, 14:50] == [0, 255, 0]).all()  # well inside the green third: pure green
    assert (got[:, :8, 0] > 200).all() and (got[:, -8:, 2] > 200).all()  # red and blue on both sides, evenly
    # ... and its latents reach prepare_inputs beside the target's, as the plugin's VAE makes them
    encoders = plugin.require("load_encoders", model_config=config, device=torch.device("cpu"))
    direct = plugin.call("encode_batch", encoders=encoders, batch=EncodeBatch(pixels=decoded[None], control_index=0))
    row = rows_by_id(ds)["data/wide.png"]
    assert sorted(row) == ["control_0_latents", "latents", "text_embeds"]
    torch.testing.assert_close(row[control_key(0, "latents")], direct["latents"][0], rtol=1e-5, atol=1e-6)


def test_a_control_folder_without_pairs_is_an_error_before_any_work(tmp_path: Path, model_dir: Path) -> None:
    target(tmp_path, "a.png")
    control(tmp_path, "a.png")
    (tmp_path / "other").mkdir()
    write_png(tmp_path / "other" / "b.png", 64, 64)
    (tmp_path / "other" / "b.txt").write_text("b", encoding="utf-8")
    control(tmp_path, "unrelated.png", folder="wrong")
    dataset = toml(tmp_path, '[[directory]]\npath = "data"\ncontrol_path = "control"\n\n'
                             '[[directory]]\npath = "other"\ncontrol_path = "wrong"\n')
    plugin, recorder = registered("reference-edit", edit_plugin)
    with pytest.raises(DatasetError) as info:
        scan_dataset(load_dataset_config(dataset), plugin.spec)
    assert str(info.value) == (f"directory[1].control_path: {tmp_path / 'wrong'} has no control image paired with a "
                               "target of directory[1] (controls pair by relative path and stem: a/b.png in the "
                               "media folder <-> a/b.jpg in the control folder)")
    assert [s.path.name for s in info.value.result.skipped] == ["b.png"]  # `diffpipe data` still lists why
    config = plugin.spec.config_schema(type="reference-edit", path=model_dir)
    with pytest.raises(DatasetError, match="has no control image paired"):
        _cache(dataset, plugin, config)
    assert recorder.batches == [] and not list((tmp_path / "cache").rglob("*.arrow"))  # nothing encoded


def test_what_the_model_does_not_take_is_a_config_error(tmp_path: Path) -> None:
    target(tmp_path, "a.png")
    control(tmp_path, "a.png")
    control(tmp_path, "a.png", folder="second")
    one = '[[directory]]\npath = "data"\ncontrol_path = "control"\n'
    two = '[[directory]]\npath = "data"\ncontrol_path = ["control", "second"]\n'
    cases = [
        (reference_plugin, one, "directory[0].control_path: model 'reference' does not train on control images"),
        (edit_plugin, two, "2 control folders, but model 'reference-edit' takes at most 1 control image per target"),
        (SpecVariant(control_images="required"), '[[directory]]\npath = "data"\n',
         "directory[0]: model 'reference-edit' trains on edit pairs only; give control_path"),
    ]
    for plugin_obj, directories, message in cases:
        name = "reference" if plugin_obj is reference_plugin else "reference-edit"
        plugin, _ = registered(name, plugin_obj)
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            scan_dataset(load_dataset_config(toml(tmp_path, directories)), plugin.spec)
    with pytest.raises(ConfigError, match=r"directory\[0\]\.control_path\[1\]: directory not found: .*missing"):
        load_dataset_config(toml(tmp_path, '[[directory]]\npath = "data"\ncontrol_path = ["control", "missing"]\n'))
    with pytest.raises(ConfigError, match="is the media folder itself"):
        load_dataset_config(toml(tmp_path, '[[directory]]\npath = "data"\ncontrol_path = "data"\n'))


def test_own_size_controls_get_their_own_bucket(tmp_path: Path) -> None:
    """``ModelSpec.control_size = "own"``: a control image goes to its own aspect-ratio bucket at the target's
    resolution, resized to cover it and center-cropped there."""
    target(tmp_path, "wide.png", size=(64, 64))
    wide = stripes(tmp_path / "control" / "wide.png", 96, 48)
    dataset = toml(tmp_path, '[[directory]]\npath = "data"\ncontrol_path = "control"\n',
                   top="resolutions = [64]\nenable_ar_bucket = true\n")
    plugin, _ = registered("reference-edit", SpecVariant(control_size="own"))
    (item,) = scan_dataset(load_dataset_config(dataset), plugin.spec).items
    # 7 log-spaced ratios 0.5..2 at 64^2 rounded to 16: 96x48 (ratio 2) is nearest to 80x48 (1.67; 80x32 is 2.5)
    assert item.bucket == Bucket(64, 64) and item.controls[0].bucket == Bucket(80, 48)
    decoded = load_media(control_work("", item, 0).item, plugin.spec).pixels
    assert decoded.shape == (3, 48, 80)
    assert np.abs(as_uint8(decoded) - cover_and_center_crop(wide, 80, 48)).max() <= 1


def test_a_sample_control_image_is_encoded_at_the_models_control_sample_area(tmp_path: Path) -> None:
    """``ModelSpec.control_sample_area``: a sample's control image at that area whatever the sample size, its aspect
    ratio kept and its sides rounded as diffusers' edit pipelines round them (``calculate_dimensions``); without
    it, at the sample's pixel count (sides rounded down to the model's multiple)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    from diffpipe_core.sampling.prompts import load_control

    image = stripes(tmp_path / "control.png", 300, 200)
    spec = dataclasses.replace(edit_plugin.EDIT_SPEC, control_size="own", control_sample_area=512 * 512)
    pixels = load_control(image, spec, (64, 64))
    width, height = calculate_dimensions(512 * 512, 300 / 200)
    assert pixels.shape == (3, height, width) == (3, 416, 640)
    assert np.abs(as_uint8(pixels) - cover_and_center_crop(image, 640, 416)).max() <= 1
    plain = load_control(image, dataclasses.replace(spec, control_sample_area=None), (64, 64))
    assert plain.shape == (3, 48, 64)  # 64 x 64 pixels at 3:2: 78 x 52, rounded down to 16
    with pytest.raises(ValueError, match="control_sample_area is for control_size = 'own'"):
        dataclasses.replace(spec, control_size="target")


def test_items_with_and_without_control_images_batch_apart(tmp_path: Path, model_dir: Path) -> None:
    """``control_images = "optional"``: a directory with control images and one without train side by side; a
    micro-batch holds either every item's control tensors or none."""
    for i in range(2):
        target(tmp_path, f"e{i}.png", seed=i)
        control(tmp_path, f"e{i}.png", seed=10 + i)
    (tmp_path / "plain").mkdir()
    for i in range(2):
        write_png(tmp_path / "plain" / f"p{i}.png", 64, 64, seed=20 + i)
        (tmp_path / "plain" / f"p{i}.txt").write_text(f"plain {i}", encoding="utf-8")
    dataset = toml(tmp_path, '[[directory]]\npath = "data"\ncontrol_path = "control"\n\n'
                             '[[directory]]\npath = "plain"\n')
    plugin, _ = registered("reference-edit", edit_plugin)
    ds = _cache(dataset, plugin, plugin.spec.config_schema(type="reference-edit", path=model_dir))
    groups = [sorted(ds.sample_ids(g)) for g in ds.groups()]
    assert groups == [["plain/p0.png", "plain/p1.png"], ["data/e0.png", "data/e1.png"]]
    plain, edits = (ds.collate(g) for g in ds.groups())
    assert sorted(plain) == ["latents", "text_embeds"]
    assert sorted(edits) == ["control_0_latents", "latents", "text_embeds"]
    assert edits["control_0_latents"].shape == edits["latents"].shape == (2, 4, 8, 8)
    with pytest.raises(ValueError, match=r"2 buckets \(64x64, 64x64\+control 64x64\)"):
        ds.collate([ds.groups()[0][0], ds.groups()[1][0]])


# ------------------------------------------------------------------------------------------------- test 2
def _two_control_dataset(tmp_path: Path) -> Path:
    for i in range(3):
        target(tmp_path, f"t{i}.png", seed=i)
        control(tmp_path, f"t{i}.png", seed=10 + i, folder="first")
        control(tmp_path, f"t{i}.png", seed=20 + i, folder="second")
    return toml(tmp_path, '[[directory]]\npath = "data"\ncontrol_path = ["first", "second"]\n')


def test_one_changed_control_image_reencodes_that_control_latent_only(tmp_path: Path, model_dir: Path) -> None:
    dataset = _two_control_dataset(tmp_path)
    plugin, recorder = registered("reference-edit", SpecVariant(max_control_images=2))
    config = plugin.spec.config_schema(type="reference-edit", path=model_dir)
    ds = _cache(dataset, plugin, config)
    assert sorted(b.control_index for b in recorder.controls()) == [0, 0, 1, 1]  # 3 + 3 in batches of 2
    assert sum(len(b.pixels) for b in recorder.media()) == 3 and len(recorder.captions()) == 3
    before = rows_by_id(ds)
    assert sorted(before["data/t1.png"]) == ["control_0_latents", "control_1_latents", "latents", "text_embeds"]

    recorder.reset()
    for trust in (False, True):  # nothing changed: the cache opens from its index, control images included
        again = rows_by_id(_cache(dataset, plugin, config, trust_cache=trust))
        assert recorder.batches == [] and again.keys() == before.keys()
        assert all(torch.equal(again[i][k], before[i][k]) for i in before for k in before[i])

    changed = control(tmp_path, "t1.png", seed=99, folder="second")
    touch_later(changed)
    ds = _cache(dataset, plugin, config)
    (batch,) = recorder.batches  # one control image of one target, and nothing else
    assert batch.control_index == 1 and len(batch.pixels) == 1
    (item,) = [i for i in scan_dataset(load_dataset_config(dataset), plugin.spec).items if i.id == "data/t1.png"]
    assert item.controls[1].path == changed
    assert torch.equal(batch.pixels[0], load_media(control_work("", item, 1).item, plugin.spec).pixels)
    assert ds.summary["encoded_controls"] == 1 and ds.summary["reused_controls"] == 5
    assert ds.summary["encoded_media_all_ranks"] == 0 and ds.summary["encoded_captions_all_ranks"] == 0
    after = rows_by_id(ds)
    for sample_id, row in after.items():
        for key, tensor in row.items():
            if (sample_id, key) == ("data/t1.png", "control_1_latents"):
                assert not torch.equal(tensor, before[sample_id][key])
                encoders = plugin.require("load_encoders", model_config=config, device=torch.device("cpu"))
                direct = plugin.call("encode_batch", encoders=encoders,
                                     batch=EncodeBatch(pixels=batch.pixels, control_index=1))["latents"][0]
                torch.testing.assert_close(tensor, direct, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(tensor, before[sample_id][key]), (sample_id, key)


def test_captions_that_see_control_images_are_keyed_by_them(tmp_path: Path, model_dir: Path) -> None:
    """``ModelSpec.control_in_captions`` (a vision-language text encoder, Qwen-Image-Edit): caption batches carry
    each caption's control images, and a changed control re-encodes that control and its item's caption."""
    dataset = _two_control_dataset(tmp_path)
    plugin, recorder = registered("reference-edit", SpecVariant(max_control_images=2, control_in_captions=True))
    config = plugin.spec.config_schema(type="reference-edit", path=model_dir)
    _cache(dataset, plugin, config)
    items = {i.caption: i for i in scan_dataset(load_dataset_config(dataset), plugin.spec).items}
    caption_batches = [b for b in recorder.batches if b.captions is not None]
    assert sum(len(b.captions) for b in caption_batches) == 3
    for b in caption_batches:
        for caption, pixels in zip(b.captions, b.control_pixels):
            item = items[caption]
            assert len(pixels) == 2
            for k in range(2):
                assert torch.equal(pixels[k], load_media(control_work("", item, k).item, plugin.spec).pixels)

    recorder.reset()
    touch_later(control(tmp_path, "t2.png", seed=77, folder="first"))
    _cache(dataset, plugin, config)
    assert [b.control_index for b in recorder.controls()] == [0] and recorder.media() == []
    assert recorder.captions() == ["edit t2"]  # the caption is the same text, but it sees another image now


# ------------------------------------------------------------------------------------------------- test 5
def _clips(root: Path, n: int = 2) -> Path:
    for i in range(n):
        write_video(root / "clips" / f"clip{i}.mp4", frames=6, fps=8, size=(32, 32), seed=i)
        (root / "clips" / f"clip{i}.txt").write_text(f"clip {i}", encoding="utf-8")
    return toml(root, '[[directory]]\npath = "clips"\n', top="resolutions = [32]\nframe_buckets = [5]\n")


def test_a_first_frame_model_gets_each_clips_first_frame_cached_with_the_clip(tmp_path: Path, model_dir: Path) -> None:
    dataset = _clips(tmp_path)
    plugin, recorder = registered("reference-i2v", i2v_plugin)
    config = plugin.spec.config_schema(type="reference-i2v", path=model_dir)
    ds = _cache(dataset, plugin, config)
    (batch,) = recorder.media()
    items = {i.path: i for i in scan_dataset(load_dataset_config(dataset), plugin.spec).items}
    assert batch.pixels.shape == (2, 3, 5, 32, 32) and batch.first_frames.shape == (2, 3, 32, 32)
    decoded = [load_media(item, plugin.spec).pixels for item in items.values()]
    firsts = {bytes(d[:, 0].numpy().tobytes()) for d in decoded}
    assert {bytes(f.numpy().tobytes()) for f in batch.first_frames} == firsts  # the clips' own first frames
    rows = rows_by_id(ds)
    assert sorted(rows["clips/clip0.mp4"]) == ["first_frame_latents", "image_embeds", "latents", "text_embeds"]
    assert rows["clips/clip0.mp4"]["first_frame_latents"].shape == (4, 4, 4)

    # The first frame is part of what the clip's entry depends on: a model without first_frame keys it apart.
    from diffpipe_core.data.cache_keys import media_key

    item = next(iter(items.values()))
    assert media_key(item, "none", "fp", True) != media_key(item, "none", "fp")


def test_an_image_in_an_image_to_video_only_dataset_is_refused_naming_it(tmp_path: Path) -> None:
    dataset = _clips(tmp_path)
    still = tmp_path / "clips" / "still.png"
    write_png(still, 32, 32)
    still.with_suffix(".txt").write_text("still", encoding="utf-8")
    plugin, _ = registered("reference-i2v", i2v_plugin)
    with pytest.raises(DatasetError) as info:
        scan_dataset(load_dataset_config(dataset), plugin.spec)
    assert str(info.value) == ("1 image in the dataset, but model 'reference-i2v' trains image-to-video only (each "
                               f"item is a video clip conditioned on its first frame): {still}; remove it or use "
                               "videos")
    # a video model that conditions on first frames only optionally trains images as before
    optional = dataclasses.replace(i2v_plugin.I2V_SPEC, first_frame="optional")
    assert {i.path.name for i in scan_dataset(load_dataset_config(dataset), optional).items} == {
        "clip0.mp4", "clip1.mp4", "still.png"}


class ControlVideos:
    """The reference i2v model's spec as a video-to-video model (``control_videos``): the encoders record the pixels
    of every batch (targets, control videos, captions) as the cached tensors."""

    spec = dataclasses.replace(i2v_plugin.I2V_SPEC, name="reference-v2v", first_frame="none",
                               control_images="required", control_videos=True)

    @hookimpl
    def model_spec(self):
        return self.spec

    @hookimpl
    def load_encoders(self, model_config, device):
        return object()

    @hookimpl
    def encode_batch(self, encoders, batch):
        if batch.captions is not None:
            return {"text": torch.zeros(len(batch.captions), 2)}
        return {"pixels": batch.pixels.clone()}


def test_control_videos_are_decoded_at_each_clips_frames_and_missing_ones_stop_the_scan(
    tmp_path: Path, model_dir: Path
) -> None:
    """``ModelSpec.control_videos``: each clip's control video (paired by stem, larger, longer) reaches
    ``encode_batch`` as a control batch of the clip's frames at its bucket, decoded from the clip's start; keys
    differ per clip start; a clip without its control video is an error naming both files before any work."""
    from diffpipe_core.data.cache_keys import control_key as cache_control_key

    dataset = _clips(tmp_path)
    for i in range(2):
        write_video(tmp_path / "control" / f"clip{i}.mov", frames=8, fps=8, size=(48, 40), seed=10 + i)
    text = dataset.read_text().replace('path = "clips"\n', 'path = "clips"\ncontrol_path = "control"\n')
    dataset.write_text(text, encoding="utf-8")
    plugin, recorder = registered("reference-v2v", ControlVideos())
    items = scan_dataset(load_dataset_config(dataset), plugin.spec).items
    assert [(i.controls[0].path.name, i.controls[0].bucket, i.controls[0].clip_start) for i in items] == [
        ("clip0.mov", Bucket(32, 32, 5), 0.0), ("clip1.mov", Bucket(32, 32, 5), 0.0)]
    _cache(dataset, plugin, plugin.spec.config_schema(type="reference-v2v", path=model_dir))
    (batch,) = recorder.controls()
    assert batch.control_index == 0 and batch.pixels.shape == (2, 3, 5, 32, 32)
    want = [load_media(control_work("k", item, 0).item, plugin.spec).pixels for item in items]
    assert sorted(bytes(p.numpy().tobytes()) for p in batch.pixels) == sorted(bytes(w.numpy().tobytes()) for w in want)
    later = dataclasses.replace(items[0].controls[0], clip_start=0.25)
    assert cache_control_key(later, 0, "fp") != cache_control_key(items[0].controls[0], 0, "fp")

    (tmp_path / "control" / "clip1.mov").unlink()
    recorder.reset()
    with pytest.raises(DatasetError) as info:
        _cache(dataset, plugin, plugin.spec.config_schema(type="reference-v2v", path=model_dir))
    missing = f"{tmp_path / 'control' / 'clip1'}.<video extension>"
    assert str(info.value) == (f"{tmp_path / 'clips' / 'clip1.mp4'}: no control video: {missing} not found "
                               "(directory[0].control_path)")
    assert recorder.batches == []


class PairedVideos(ControlVideos):
    """:class:`ControlVideos` reading control masks and reference images (``ModelSpec.paired_files``)."""

    spec = dataclasses.replace(ControlVideos.spec, name="reference-v2v-paired",
                               paired_files=("control_mask", "reference"))

    @hookimpl
    def model_spec(self):
        return self.spec

    @hookimpl
    def encode_batch(self, encoders, batch):
        if batch.captions is not None:
            return {"text": torch.zeros(len(batch.captions), 2)}
        out = {"pixels": batch.pixels.clone()}
        if batch.control_masks is not None:
            out["mask"] = batch.control_masks.clone()
        return out


def _paired_dataset(root: Path) -> Path:
    """Two clips, their control videos, a mask video and a mask image, two folders of reference images."""
    dataset = _clips(root)
    for i in range(2):
        write_video(root / "control" / f"clip{i}.mov", frames=8, fps=8, size=(48, 40), seed=10 + i)
    write_video(root / "masks" / "clip0.mp4", frames=8, fps=8, size=(48, 40), seed=20)
    write_png(root / "masks" / "clip1.png", 48, 40, seed=21)  # one mask image for every frame
    for folder, sizes in (("refs", [(20, 30), (24, 24)]), ("refs2", [(40, 16), (16, 16)])):
        (root / folder).mkdir()
        for i, (w, h) in enumerate(sizes):
            write_png(root / folder / f"clip{i}.png", w, h, seed=30 + i)
    keys = 'control_path = "control"\ncontrol_mask_path = "masks"\nreference_path = ["refs", "refs2"]\n'
    dataset.write_text(dataset.read_text().replace('path = "clips"\n', 'path = "clips"\n' + keys), encoding="utf-8")
    return dataset


def test_paired_files_are_decoded_with_their_control_keyed_by_content_and_missing_ones_stop_the_scan(
    tmp_path: Path, model_dir: Path
) -> None:
    """``ModelSpec.paired_files``: each clip's control mask (a video at the control clip's frames and crop, or an image
    held over them) and reference images (at their own size, in reference_path order) reach ``encode_batch`` with its
    control video; ``diffpipe data`` counts them per bucket; changing only one mask re-encodes that control alone; a
    missing reference image is an error naming both files before any work, and a key the model does not read is a
    config error naming it."""
    from diffpipe_core.data.decode import load_paired

    dataset = _paired_dataset(tmp_path)
    plugin, recorder = registered("reference-v2v-paired", PairedVideos())
    scan = scan_dataset(load_dataset_config(dataset), plugin.spec)
    assert [(i.controls[0].path.name, [(f.role, f.path.name) for f in i.controls[0].paired]) for i in scan.items] == [
        ("clip0.mov", [("control_mask", "clip0.mp4"), ("reference", "clip0.png"), ("reference", "clip0.png")]),
        ("clip1.mov", [("control_mask", "clip1.png"), ("reference", "clip1.png"), ("reference", "clip1.png")])]
    report = format_report(scan, 1, 1)
    assert "with control mask  with references" in report and report.splitlines()[-5].split()[-4:] == [
        "2", "2", "2", "0"], report

    ds = _cache(dataset, plugin, plugin.spec.config_schema(type="reference-v2v-paired", path=model_dir))
    (batch,) = recorder.controls()
    assert batch.control_masks.shape == (2, 1, 5, 32, 32) and 0 <= batch.control_masks.min() < batch.control_masks.max()
    assert [[tuple(r.shape) for r in refs] for refs in batch.references] == [[(3, 30, 20), (3, 16, 40)],
                                                                              [(3, 24, 24), (3, 16, 16)]]
    work = {control_work("k", item, 0).item.path.name: control_work("k", item, 0).item for item in scan.items}
    for j, name in enumerate(["clip0.mov", "clip1.mov"]):
        item = work[name]
        want = [load_paired(item, f, plugin.spec) for f in item.paired]
        torch.testing.assert_close(batch.control_masks[j], want[0], rtol=0, atol=0)
        assert all(torch.equal(a, b) for a, b in zip(batch.references[j], want[1:], strict=True))
    assert torch.equal(batch.control_masks[1, :, 0], batch.control_masks[1, :, 4])  # the image: every frame
    assert rows_by_id(ds)["clips/clip0.mp4"]["control_0_mask"].shape == (1, 5, 32, 32)

    mask = tmp_path / "masks" / "clip1.png"
    write_png(mask, 48, 40, seed=99)
    touch_later(mask)
    recorder.reset()
    ds = _cache(dataset, plugin, plugin.spec.config_schema(type="reference-v2v-paired", path=model_dir))
    (again,) = recorder.controls()
    assert again.control_masks.shape[0] == 1 and ds.summary["encoded_controls"] == 1 and not recorder.media()

    (tmp_path / "refs2" / "clip0.png").unlink()
    recorder.reset()
    with pytest.raises(DatasetError) as info:
        _cache(dataset, plugin, plugin.spec.config_schema(type="reference-v2v-paired", path=model_dir))
    assert str(info.value) == (f"{tmp_path / 'clips' / 'clip0.mp4'}: no reference image: "
                               f"{tmp_path / 'refs2' / 'clip0'}.<image extension> not found "
                               "(directory[0].reference_path[1])")
    assert recorder.batches == []
    broken = tmp_path / "refs2" / "clip0.png"
    broken.write_bytes(b"not a png")  # unreadable: named with the clip
    clip0 = tmp_path / "clips" / "clip0.mp4"
    with pytest.raises(DatasetError, match=f"{clip0}: unreadable reference image: .*{broken}"):
        scan_dataset(load_dataset_config(dataset), plugin.spec)
    write_png(broken, 20, 30)
    write_png(mask, 40, 40)  # a mask of another size than its control video
    with pytest.raises(DatasetError, match=f"control mask size: {mask} is 40x40 but its control video .*clip1.mov is "
                                           "48x40"):
        scan_dataset(load_dataset_config(dataset), plugin.spec)

    other, _ = registered("reference-v2v", ControlVideos())
    with pytest.raises(ConfigError, match=r"directory\[0\].control_mask_path: model 'reference-v2v' does not read "
                                          "control masks"):
        scan_dataset(load_dataset_config(dataset), other.spec)


# ------------------------------------------------------------------------------------- first-frame conditioning
def ltx_first_frame_today(latents, x_t, t, p, generator, evaluating):
    """A copy of LTX-Video's first-frame conditioning as ``diffpipe_ltx/inputs.py`` has it (before it calls the
    shared function): the draw and the masking, verbatim."""
    b, _, f, h, w = latents.shape
    draw = torch.rand(b, generator=generator)  # drawn always, so p does not change the other draws
    conditioned = (draw < p) & (f > 1) & (not evaluating)
    x_t[conditioned, :, 0] = latents[conditioned, :, 0]  # t = 0 on that frame: exactly the clean latents
    frame_t = t[:, None].repeat(1, f)
    frame_t[conditioned, 0] = 0.0
    weight = torch.ones(b, 1, f, h, w)
    weight[conditioned, :, 0] = 0.0
    return x_t, frame_t, weight


@pytest.mark.parametrize("p, frames, evaluating", [(0.5, 3, False), (1.0, 2, False), (0.0, 3, False),
                                                    (0.7, 1, False), (1.0, 3, True)])
def test_first_frame_conditioning_draws_exactly_what_ltx_draws(p: float, frames: int, evaluating: bool) -> None:
    for seed in range(6):
        out = []
        for fn in ("shared", "ltx"):
            g = torch.Generator().manual_seed(seed)
            latents = torch.randn(6, 4, frames, 3, 5, generator=g)  # the micro-batch, drawn elsewhere
            noise = torch.randn(latents.shape, generator=g)  # then LTX's own order: noise, t, the draw
            t = sample_timesteps(6, g, "logit_normal", 1.0, 2.0)
            x_t, _ = flow_matching_pair(latents, noise, t)
            if fn == "shared":
                r = first_frame_conditioning(latents, x_t, t, p, g, evaluating=evaluating)
                assert r.conditioned.dtype == torch.bool and r.weight.dtype == torch.float32
                out.append((r.x_t, r.frame_t, r.weight, torch.rand(3, generator=g)))
            else:
                out.append((*ltx_first_frame_today(latents, x_t, t, p, g, evaluating), torch.rand(3, generator=g)))
        for mine, theirs in zip(*out):  # bit for bit, and the generator is left where LTX leaves it
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)
    if p == 1.0 and frames > 1 and not evaluating:
        assert torch.equal(r.x_t[:, :, 0], latents[:, :, 0]) and r.weight[:, :, 0].eq(0).all() and r.conditioned.all()
    if frames == 1 or evaluating or p == 0.0:
        assert not r.conditioned.any() and torch.equal(r.x_t, x_t)


def test_model_spec_conditioning_fields_are_checked() -> None:
    with pytest.raises(ValueError, match="control_images is 'yes'; valid: 'none', 'optional', 'required'"):
        dataclasses.replace(edit_plugin.EDIT_SPEC, control_images="yes")
    with pytest.raises(ValueError, match="first_frame conditioning is for video models"):
        dataclasses.replace(edit_plugin.EDIT_SPEC, first_frame="required")
    with pytest.raises(ValueError, match="max_control_images must be at least 1"):
        dataclasses.replace(edit_plugin.EDIT_SPEC, max_control_images=0)
    with pytest.raises(ValueError, match="control_videos is for video models with control_images set"):
        dataclasses.replace(edit_plugin.EDIT_SPEC, control_videos=True)
