"""Issue 15: opening a fully cached dataset on the default path checks files and encoders through the scan
index and the plan digest, without recomputing every cache key; any change still goes the whole way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import diffpipe_reference.plugin as reference_plugin
from diffpipe_core.data import cache as cache_module
from diffpipe_core.data import prepare_cache
from diffpipe_core.registry import Registry
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_reference.model import write_tiny_model


@pytest.fixture
def cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    registry = Registry()
    registry.register_model("reference", reference_plugin)
    plugin = registry.model("reference")
    config = plugin.spec.config_schema(type="reference", path=write_tiny_model(tmp_path / "model"))
    write_image_dataset(tmp_path / "data", 4, size=[(64, 64), (96, 48), (64, 64), (48, 96)])
    toml = write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "data", resolutions=[64], enable_ar_bucket=True)
    first = prepare_cache(toml, plugin, config, progress=False)
    assert first.summary["encoded_media"] == 4
    planned: list[str] = []  # items whose media cache key was computed: the full planning path
    real_media_key = cache_module.media_key
    monkeypatch.setattr(cache_module, "media_key", lambda item, *a: planned.append(item.id) or real_media_key(item, *a))
    return tmp_path, toml, plugin, config, first, planned


def test_unchanged_dataset_opens_from_the_index(cached) -> None:
    tmp_path, toml, plugin, config, first, planned = cached
    ds = prepare_cache(toml, plugin, config, progress=False)
    assert planned == []  # no cache key recomputed: the plan digest matched the index
    assert ds.summary["encoded_media"] == 0 and ds.summary["encoded_captions"] == 0
    assert ds.sample_ids(list(range(len(ds)))) == first.sample_ids(list(range(len(first))))
    assert [e.media_key for e in ds.entries] == [e.media_key for e in first.entries]


def test_a_changed_caption_or_encoder_is_not_served_from_the_index(cached) -> None:
    tmp_path, toml, plugin, config, first, planned = cached
    txt = tmp_path / "data" / "img_001.txt"
    st = txt.stat()
    txt.write_text("caption 9", encoding="utf-8")  # same length, later mtime
    os.utime(txt, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    ds = prepare_cache(toml, plugin, config, progress=False)
    assert len(planned) == 4 and ds.summary["encoded_captions"] == 1 and ds.summary["encoded_media"] == 0

    planned.clear()
    write_tiny_model(tmp_path / "model", seed=1)  # other encoder weights in place, same path
    ds = prepare_cache(toml, plugin, config, progress=False)
    assert len(planned) == 4 and ds.summary["encoded_media"] == 4

    planned.clear()
    assert prepare_cache(toml, plugin, config, progress=False).summary["encoded_media"] == 0
    assert planned == []

    (index,) = (tmp_path / "cache").glob("reference/*/index.json")
    index.write_text('[["damaged"]]')
    planned.clear()
    ds = prepare_cache(toml, plugin, config, progress=False)  # planned again from the scan, index rewritten
    assert len(planned) == 4 and ds.summary["encoded_media"] == 0 and len(ds) == 4
