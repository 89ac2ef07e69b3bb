"""The dataset TOML: validation errors, path resolution, per-directory overrides, caption features."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from diffpipe_core.data.dataset_config import DatasetConfig, DirectoryConfig, load_dataset_config
from diffpipe_core.data.scan import scan_dataset
from diffpipe_core.schema import ConfigError
from diffpipe_core.types import ModelConfigBase, ModelSpec

SPEC = ModelSpec(name="img", modality="image", config_schema=ModelConfigBase, spatial_multiple=16)


def write_toml(tmp_path: Path, text: str, name: str = "dataset.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def image(path: Path, size: tuple[int, int] = (64, 64), caption: str | None = "a photo") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (120, 30, 200)).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def test_relative_paths_resolve_against_the_toml_and_cache_dir_defaults(tmp_path: Path) -> None:
    (tmp_path / "sub" / "imgs").mkdir(parents=True)
    (tmp_path / "sub" / "masks").mkdir()
    toml = write_toml(
        tmp_path / "sub",
        """
resolutions = [256, [320, 192]]
enable_ar_bucket = true
[[directory]]
path = "imgs"
mask_path = "masks"
num_repeats = 3
""",
    )
    cfg = load_dataset_config(toml)
    assert cfg.directory[0].path == tmp_path / "sub" / "imgs"
    assert cfg.directory[0].mask_path == tmp_path / "sub" / "masks"
    assert cfg.directory[0].num_repeats == 3
    assert cfg.cache_dir == tmp_path / "sub" / "cache"
    assert cfg.resolutions == [256, (320, 192)]
    assert cfg.source == toml


def test_missing_directory_path_is_a_validation_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "ok").mkdir()
    toml = write_toml(tmp_path, '[[directory]]\npath = "ok"\n[[directory]]\npath = "nope"\nmask_path = "gone"\n')
    with pytest.raises(ConfigError) as info:
        load_dataset_config(toml)
    problems = info.value.problems
    assert any("directory[1].path" in p and str(tmp_path / "nope") in p and "not found" in p for p in problems)
    assert any("directory[1].mask_path" in p and str(tmp_path / "gone") in p for p in problems)
    assert all(str(toml) in p for p in problems)
    assert not any("directory[0]" in p for p in problems)


def test_misspelt_and_invalid_keys_are_all_reported(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    toml = write_toml(
        tmp_path,
        """
resolution = [512]
video_clip_mode = "middle"
uncond_fraction = 1.5
[[directory]]
path = "d"
num_repeat = 2
""",
    )
    with pytest.raises(ConfigError) as info:
        load_dataset_config(toml)
    text = "\n".join(info.value.problems)
    assert "unknown key 'resolution'" in text and "Did you mean 'resolutions'?" in text
    assert "directory[0].num_repeat" in text and "Did you mean 'num_repeats'?" in text
    assert "video_clip_mode: invalid value 'middle'" in text and "'single_middle'" in text
    assert "uncond_fraction: invalid value 1.5" in text
    assert len(info.value.problems) == 4


def test_directory_written_as_a_single_table_is_explained(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    toml = write_toml(tmp_path, '[directory]\npath = "d"\n')
    with pytest.raises(ConfigError, match=r"write \[\[directory\]\]"):
        load_dataset_config(toml)


def test_min_ar_above_max_ar_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    toml = write_toml(tmp_path, 'enable_ar_bucket = true\n[[directory]]\npath = "d"\nmin_ar = 3.0\n')
    with pytest.raises(ConfigError, match=r"directory\[0\]\.min_ar: 3\.0 is larger than max_ar 2\.0"):
        load_dataset_config(toml)


def test_per_directory_overrides_merge_over_the_top_level(tmp_path: Path) -> None:
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    toml = write_toml(
        tmp_path,
        """
resolutions = [512]
enable_ar_bucket = true
frame_buckets = [1, 33]
caption_prefix = "top, "
[[directory]]
path = "a"
[[directory]]
path = "b"
resolutions = [256]
ar_buckets = [[4, 3], 1.0]
caption_prefix = "b: "
frame_buckets = [1, 17]
allow_empty_captions = true
""",
    )
    cfg = load_dataset_config(toml)
    a, b = cfg.settings_for(0), cfg.settings_for(1)
    assert a.resolutions == (512,) and a.caption_prefix == "top, " and a.frame_buckets == (1, 33)
    assert (a.min_ar, a.max_ar, a.num_ar_buckets, a.ar_buckets) == (0.5, 2.0, 7, None)
    assert b.resolutions == (256,) and b.caption_prefix == "b: " and b.frame_buckets == (1, 17)
    assert b.ar_buckets == (4 / 3, 1.0) and (b.min_ar, b.max_ar) == (1.0, 4 / 3)  # range follows ar_buckets
    assert b.allow_empty_captions and not a.allow_empty_captions


def test_every_key_is_documented() -> None:
    for cls in (DatasetConfig, DirectoryConfig):
        undocumented = [name for name, f in cls.model_fields.items() if not f.description]
        assert undocumented == [], f"{cls.__name__} keys without description: {undocumented}"


def test_captions_json_prefix_and_empty_caption_rules(tmp_path: Path) -> None:
    data = tmp_path / "data"
    image(data / "txt.png", caption="from the txt file")
    image(data / "json.png", caption=None)
    image(data / "nested" / "deep.png", caption=None)
    image(data / "none.png", caption=None)
    (data / "captions.json").write_text(
        json.dumps({"json.png": "from captions.json", "nested/deep.png": "nested entry"}), encoding="utf-8"
    )
    toml = write_toml(tmp_path, 'caption_prefix = "style, "\n[[directory]]\npath = "data"\n')
    scan = scan_dataset(load_dataset_config(toml), SPEC)
    captions = {item.id: item.caption for item in scan.items}
    assert captions == {
        "data/txt.png": "style, from the txt file",
        "data/json.png": "style, from captions.json",
        "data/nested/deep.png": "style, nested entry",
    }
    assert [(s.path.name, s.reason.split(":")[0]) for s in scan.skipped] == [("none.png", "no caption")]

    toml = write_toml(tmp_path, '[[directory]]\npath = "data"\nallow_empty_captions = true\n', "allow.toml")
    scan = scan_dataset(load_dataset_config(toml), SPEC)
    assert {item.id: item.caption for item in scan.items}["data/none.png"] == ""
    assert scan.skipped == []


def test_shuffled_tag_variants_are_deterministic_and_keep_the_prefix(tmp_path: Path) -> None:
    image(tmp_path / "data" / "x.png", caption="red, blue, green, tall, small, round")
    toml = write_toml(
        tmp_path, 'caption_prefix = "tok, "\nshuffle_tags = true\ncache_shuffle_num = 5\n[[directory]]\npath = "data"\n'
    )
    cfg = load_dataset_config(toml)
    first = scan_dataset(cfg, SPEC).items[0]
    again = scan_dataset(cfg, SPEC).items[0]
    assert first.caption == "tok, red, blue, green, tall, small, round"
    assert len(first.caption_variants) == 5
    assert first.caption_variants == again.caption_variants  # stable across scans: the text cache stays valid
    tags = sorted("red, blue, green, tall, small, round".split(", "))
    for variant in first.caption_variants:
        assert variant.startswith("tok, ")
        assert sorted(variant[len("tok, ") :].split(", ")) == tags
    assert len(set(first.caption_variants)) > 1

    toml = write_toml(tmp_path, '[[directory]]\npath = "data"\n', "plain.toml")
    assert scan_dataset(load_dataset_config(toml), SPEC).items[0].caption_variants == ()
