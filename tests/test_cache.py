"""The content-keyed cache: invalidation by counting encode calls (acceptance 2), equality with a direct
encode, caption dropout, resume after an interruption, decode failures and the shard store."""

from __future__ import annotations

import os
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

import diffpipe_reference.plugin as reference_plugin
from diffpipe_core import hookimpl
from diffpipe_core.data import BucketSampler, CachedDataset, prepare_cache
from diffpipe_core.data.cache_store import list_shards, write_shard
from diffpipe_core.data.dataset_config import load_dataset_config
from diffpipe_core.data.decode import load_media
from diffpipe_core.data.scan import scan_dataset
from diffpipe_core.registry import Registry
from diffpipe_core.testing.cache import rows_by_id
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset, write_png
from diffpipe_core.testing.specs import TINY_VIDEO_SPEC
from diffpipe_core.types import EncodeBatch, ModelConfigBase, ModelSpec
from diffpipe_reference.model import write_tiny_model


class EncodeCounter:
    """A generic plugin wrapping the model's encode_batch: records every batch, the real plugin encodes.

    ``fail_after``: raise instead of encoding once that many batches went through (an interruption).
    ``on_first_call``: run once before the first batch (e.g. to damage a file after the scan).
    """

    def __init__(self) -> None:
        self.captions: list[str] = []
        self.pixels: list[torch.Tensor] = []
        self.calls = 0
        self.fail_after: int | None = None
        self.on_first_call = None

    @property
    def media(self) -> int:
        return len(self.pixels)

    def reset(self) -> None:
        self.captions, self.pixels, self.calls = [], [], 0

    @hookimpl(wrapper=True)
    def encode_batch(self, encoders, batch: EncodeBatch):
        if self.on_first_call is not None:
            hook, self.on_first_call = self.on_first_call, None
            hook()
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("simulated interruption")
        self.calls += 1
        if batch.captions is not None:
            self.captions += batch.captions
        if batch.pixels is not None:
            self.pixels += list(batch.pixels.cpu())
        return (yield)


@pytest.fixture
def setup(tmp_path: Path):
    registry = Registry()
    registry.register_model("reference", reference_plugin)
    counter = EncodeCounter()
    registry.register_generic("counter", counter)
    plugin = registry.model("reference")
    model_dir = write_tiny_model(tmp_path / "model_a", seed=0)
    config = plugin.spec.config_schema(type="reference", path=model_dir)
    return tmp_path, plugin, config, counter


def _dataset(tmp_path: Path, n: int = 4, **keys) -> Path:
    sizes = [(64, 64), (64, 64), (96, 48), (96, 48), (64, 64), (96, 48)][:n]
    write_image_dataset(tmp_path / "data", n, size=sizes)
    keys = {"resolutions": [64], "enable_ar_bucket": True, **keys}
    return write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "data", **keys)


def _cache(toml: Path, plugin, config, **kw) -> CachedDataset:
    kw = {"decode_workers": 0, "progress": False, "batch_size": 2, **kw}
    return prepare_cache(toml, plugin, config, **kw)


def _direct(plugin, config, toml: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Encode every item of the dataset directly, without the cache."""
    encoders = plugin.require("load_encoders", model_config=config, device=torch.device("cpu"))
    out = {}
    for item in scan_dataset(load_dataset_config(toml), plugin.spec).items:
        decoded = load_media(item, plugin.spec)
        media = plugin.call("encode_batch", encoders=encoders, batch=EncodeBatch(pixels=decoded.pixels[None]))
        text = plugin.call("encode_batch", encoders=encoders, batch=EncodeBatch(captions=[item.caption]))
        out[item.id] = {"latents": media["latents"][0], "text_embeds": text["text_embeds"][0]}
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for sample_id in a:
        assert sorted(a[sample_id]) == sorted(b[sample_id]), sample_id
        for key in a[sample_id]:
            # rtol/atol: a batch of 2 and a batch of 1 may round differently in the last bit.
            torch.testing.assert_close(a[sample_id][key], b[sample_id][key], rtol=1e-5, atol=1e-6)


def test_cached_tensors_equal_a_direct_encode(setup):
    tmp_path, plugin, config, counter = setup
    toml = _dataset(tmp_path, n=6)
    ds = _cache(toml, plugin, config)
    assert len(ds) == 6 and sorted(len(g) for g in ds.groups()) == [3, 3]
    direct = _direct(plugin, config, toml)
    counter.reset()
    _assert_same(rows_by_id(ds), direct)
    # A second process opening the finished cache reads the same tensors without encoding anything.
    again = _cache(toml, plugin, config)
    assert counter.calls == 0
    assert again.summary["reused_media"] == 6 and again.summary["encoded_media"] == 0
    _assert_same(rows_by_id(again), direct)


def test_invalidation_reencodes_exactly_what_changed(setup):
    """Acceptance 2: edit one caption, then one image, then an encoder setting."""
    tmp_path, plugin, config, counter = setup
    toml = _dataset(tmp_path, n=4)
    _cache(toml, plugin, config)
    assert counter.media == 4 and sorted(counter.captions) == [f"caption {i}" for i in range(4)]

    counter.reset()
    _cache(toml, plugin, config)
    assert counter.calls == 0

    # One caption: that caption only.
    counter.reset()
    (tmp_path / "data" / "img_001.txt").write_text("a new caption for one", encoding="utf-8")
    ds = _cache(toml, plugin, config)
    assert counter.captions == ["a new caption for one"] and counter.media == 0
    assert ds.summary["encoded_captions"] == 1 and ds.summary["reused_media"] == 4

    # One image: that image only (and the cache serves its new latents).
    counter.reset()
    image = tmp_path / "data" / "img_002.png"
    write_png(image, 96, 48, seed=999)
    st = image.stat()
    os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a coarse-mtime filesystem must still see it
    ds = _cache(toml, plugin, config)
    assert counter.media == 1 and counter.captions == []
    item = next(i for i in scan_dataset(load_dataset_config(toml), plugin.spec).items if i.path == image)
    torch.testing.assert_close(counter.pixels[0], load_media(item, plugin.spec).pixels, rtol=0, atol=0)
    _assert_same(rows_by_id(ds), _direct(plugin, config, toml))

    # An encoder setting (the model path the spec lists in encoder_settings): everything.
    assert plugin.spec.encoder_settings == ("path",)
    counter.reset()
    config_b = plugin.spec.config_schema(type="reference", path=write_tiny_model(tmp_path / "model_b", seed=1))
    ds = _cache(toml, plugin, config_b)
    assert counter.media == 4 and len(counter.captions) == 4
    direct_b = _direct(plugin, config_b, toml)
    _assert_same(rows_by_id(ds), direct_b)
    assert not torch.equal(direct_b[item.id]["latents"], _direct(plugin, config, toml)[item.id]["latents"])
    # Both encoders' folders are kept (another run may use the first); `diffpipe cache --prune` removes one.
    assert len([p for p in (tmp_path / "cache" / "reference" / "dataset").iterdir() if p.is_dir()]) == 2

    # A setting the plugin does not list (the timestep sampler) changes nothing in the cache.
    counter.reset()
    _cache(toml, plugin, config_b.model_copy(update={"shift": 3.0}))
    assert counter.calls == 0


def test_regenerate_and_trust_cache(setup):
    tmp_path, plugin, config, counter = setup
    toml = _dataset(tmp_path, n=4)
    _cache(toml, plugin, config)
    counter.reset()
    ds = _cache(toml, plugin, config, regenerate=True)
    assert counter.media == 4 and len(counter.captions) == 4 and ds.summary["reused_media"] == 0

    # trust_cache opens the stored index without looking at the files: an edit goes unnoticed ...
    counter.reset()
    (tmp_path / "data" / "img_000.txt").write_text("edited", encoding="utf-8")
    ds = _cache(toml, plugin, config, trust_cache=True)
    assert counter.calls == 0 and len(ds) == 4
    # ... until a normal run checks again; with other encoder settings trust_cache falls back to a scan.
    ds = _cache(toml, plugin, config)
    assert counter.captions == ["edited"]
    counter.reset()
    config_b = plugin.spec.config_schema(type="reference", path=write_tiny_model(tmp_path / "model_b", seed=1))
    _cache(toml, plugin, config_b, trust_cache=True)
    assert counter.media == 4


def test_interrupted_caching_resumes(setup):
    tmp_path, plugin, config, counter = setup
    toml = _dataset(tmp_path, n=6)
    # 6 captions then 6 images, 2 per batch, one shard per batch: stop after 3 caption + 1 media batches.
    counter.fail_after = 4
    with pytest.raises(KeyboardInterrupt):
        _cache(toml, plugin, config, shard_batches=1)
    assert counter.media == 2 and len(counter.captions) == 6
    counter.reset()
    counter.fail_after = None
    ds = _cache(toml, plugin, config, shard_batches=1)
    assert counter.media == 4 and counter.captions == []
    assert ds.summary["reused_media"] == 2 and ds.summary["reused_captions"] == 6
    _assert_same(rows_by_id(ds), _direct(plugin, config, toml))


def test_caption_dropout_and_variants(setup):
    tmp_path, plugin, config, counter = setup
    write_image_dataset(tmp_path / "data", 4, captions=[f"red, square, tag{i}, small" for i in range(4)])
    toml = write_dataset_toml(
        tmp_path / "dataset.toml",
        tmp_path / "data",
        resolutions=[64],
        uncond_fraction=0.25,
        shuffle_tags=True,
        cache_shuffle_num=3,
    )
    ds = _cache(toml, plugin, config)
    assert "" in counter.captions and len(counter.captions) == 4 * 3 + 1
    encoders = plugin.require("load_encoders", model_config=config, device=torch.device("cpu"))
    empty = plugin.call("encode_batch", encoders=encoders, batch=EncodeBatch(captions=[""]))["text_embeds"][0]

    group = ds.groups()[0]
    dropped, expected = [], []
    seen: dict[int, set[bytes]] = {i: set() for i in group}
    for step in range(300):
        batch = ds.collate(group, torch.Generator().manual_seed(step))
        again = ds.collate(group, torch.Generator().manual_seed(step))
        assert all(torch.equal(batch[k], again[k]) for k in batch)  # same generator, same batch
        # the documented draws: the generator's first uniform per sample decides its dropout (below the fraction)
        draws = torch.rand(len(group), generator=torch.Generator().manual_seed(step))
        expected += (draws < 0.25).tolist()
        for j, index in enumerate(group):
            emb = batch["text_embeds"][j]
            dropped.append(torch.equal(emb, empty))
            if not dropped[-1]:
                seen[index].add(emb.numpy().tobytes())
    assert dropped == expected  # each sample on its own draw, at exactly the fraction
    assert all(len(v) == 3 for v in seen.values())  # every cached variant gets used


def test_file_damaged_after_scan_is_skipped_with_a_warning(setup, caplog):
    tmp_path, plugin, config, counter = setup
    toml = _dataset(tmp_path, n=4)
    victim = tmp_path / "data" / "img_003.png"

    def damage() -> None:  # runs during caption encoding: after the scan, before media decoding
        victim.write_bytes(victim.read_bytes()[:60])

    counter.on_first_call = damage
    with caplog.at_level("WARNING", logger="diffpipe.data"):
        ds = _cache(toml, plugin, config)
    assert any("img_003.png" in r.getMessage() for r in caplog.records)
    assert len(ds) == 3 and ds.summary["skipped"] == 1
    assert "img_003.png" in ds.summary["skipped_files"][0]["path"]
    assert not any("img_003" in s for s in ds.sample_ids(list(range(len(ds)))))
    counter.reset()
    ds = _cache(toml, plugin, config)  # now the scan itself leaves the damaged file out
    assert counter.calls == 0 and len(ds) == 3 and ds.summary["skipped"] == 1 and ds.summary["reused_media"] == 3


def test_num_repeats_expand_samples(setup):
    tmp_path, plugin, config, counter = setup
    write_image_dataset(tmp_path / "data", 2)
    toml = write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "data", {"num_repeats": 3}, resolutions=[64])
    ds = _cache(toml, plugin, config)
    assert counter.media == 2 and len(ds) == 6 and ds.summary["samples"] == 6
    ids = ds.sample_ids(list(range(6)))
    assert len(set(ids)) == 2 and all(ids.count(i) == 3 for i in ids)


def test_shard_store_round_trips_dtypes(tmp_path: Path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 2, 4, 4, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, 5, generator=g).half(),
        "ids": torch.arange(3, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
        "video": torch.randn(3, 4, 2, 2, 2, generator=g),
    }
    write_shard(tmp_path / "t", "r000", ["a", "b", "c"], tensors)
    (tmp_path / "t" / ".tmp-leftover").mkdir()  # an interrupted writer's folder is never read
    (shard,) = list_shards(tmp_path / "t")
    got = shard.gather([2, 0])
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor[[2, 0]]), name


def test_masks_are_keyed_by_content_and_default_to_ones(setup):
    tmp_path, plugin, config, counter = setup
    write_image_dataset(tmp_path / "data", 3)
    (tmp_path / "masks").mkdir()
    mask_file = tmp_path / "masks" / "img_001.png"
    half = torch.zeros(64, 64, dtype=torch.uint8)
    half[:, :32] = 255
    Image.fromarray(half.numpy()).save(mask_file)
    toml = write_dataset_toml(
        tmp_path / "dataset.toml", tmp_path / "data", {"mask_path": str(tmp_path / "masks")}, resolutions=[64]
    )
    ds = _cache(toml, plugin, config)
    masks = {sid: t["mask"] for sid, t in rows_by_id(ds).items()}
    assert len(masks) == 3
    for sample_id, mask in masks.items():
        if "img_001" in sample_id:  # left half trains, right half does not
            assert mask[..., :4].eq(1).all() and mask[..., 4:].eq(0).all()
        else:  # no mask file: every pixel trains
            assert mask.eq(1).all()

    counter.reset()
    Image.fromarray((255 - half).numpy()).save(mask_file)
    st = mask_file.stat()
    os.utime(mask_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    ds = _cache(toml, plugin, config)
    assert counter.media == 1 and counter.captions == []  # only the item whose mask changed
    mask = next(t["mask"] for sid, t in rows_by_id(ds).items() if "img_001" in sid)
    assert mask[..., :4].eq(0).all() and mask[..., 4:].eq(1).all()


def test_trust_cache_falls_back_to_a_scan_when_the_cache_cannot_serve(setup):
    tmp_path, plugin, config, counter = setup
    toml = _dataset(tmp_path, n=2)
    _cache(toml, plugin, config)
    # Turning caption dropout on needs the empty prompt, which the stored cache lacks.
    text = toml.read_text()
    toml.write_text("uncond_fraction = 0.5\n" + text)
    counter.reset()
    ds = _cache(toml, plugin, config, trust_cache=True)
    assert counter.captions == [""] and counter.media == 0 and ds.uncond_fraction == 0.5


class TinyVideoConfig(ModelConfigBase):
    scale: float = 1.0


class TinyVideo:
    """An in-process video plugin whose latents are bfloat16 (B, C, F, H/8, W/8) and text embeddings 1-D."""

    @hookimpl
    def model_spec(self) -> ModelSpec:
        return replace(TINY_VIDEO_SPEC, config_schema=TinyVideoConfig, encoder_settings=("scale",))

    @hookimpl
    def load_encoders(self, model_config: TinyVideoConfig, device):
        return model_config.scale

    @hookimpl
    def encode_batch(self, encoders, batch: EncodeBatch):
        if batch.pixels is not None:
            return {"latents": (torch.nn.functional.avg_pool3d(batch.pixels, (1, 8, 8)) * encoders).bfloat16()}
        ids = [
            torch.tensor(list(c.encode()[:8]) + [0] * (8 - len(c.encode()[:8])), dtype=torch.float32)
            for c in batch.captions
        ]
        return {"text_embeds": torch.stack(ids) * encoders}


def _write_mp4(path: Path, frames: int, fps: int, size: tuple[int, int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for _ in range(frames):
            arr = np.full((size[1], size[0], 3), rng.integers(0, 256, 3), np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")))
        container.mux(stream.encode())


def test_video_latents_in_bfloat16_round_trip(tmp_path: Path):
    registry = Registry()
    assert registry.register_model("tinyvideo", TinyVideo()).ok
    counter = EncodeCounter()
    registry.register_generic("counter", counter)
    plugin = registry.model("tinyvideo")
    (tmp_path / "data").mkdir()
    for i in range(3):
        _write_mp4(tmp_path / "data" / f"clip{i}.mp4", frames=10, fps=8, size=(32, 32), seed=i)
        (tmp_path / "data" / f"clip{i}.txt").write_text(f"clip {i}", encoding="utf-8")
    toml = write_dataset_toml(tmp_path / "dataset.toml", tmp_path / "data", resolutions=[32], frame_buckets=[1, 5, 9])
    config = TinyVideoConfig(type="tinyvideo", scale=2.0)
    ds = _cache(toml, plugin, config)
    assert counter.media == 3 and counter.pixels[0].shape == (3, 9, 32, 32)
    (group,) = ds.groups()
    batch = ds.collate(group)
    assert batch["latents"].dtype == torch.bfloat16 and batch["latents"].shape == (3, 3, 9, 4, 4)
    assert batch["text_embeds"].shape == (3, 8)
    items = {i.id: i for i in scan_dataset(load_dataset_config(toml), plugin.spec).items}
    for j, sample_id in enumerate(ds.sample_ids(group)):
        pixels = load_media(items[sample_id], plugin.spec).pixels[None]
        direct = plugin.call("encode_batch", encoders=2.0, batch=EncodeBatch(pixels=pixels))["latents"][0]
        assert torch.equal(batch["latents"][j], direct), sample_id
    counter.reset()
    _cache(toml, plugin, config.model_copy(update={"scale": 3.0}))  # an encoder setting: everything again
    assert counter.media == 3 and len(counter.captions) == 3


def test_sampler_batches_from_the_cache_collate_and_mixed_buckets_do_not(setup):
    tmp_path, plugin, config, counter = setup
    ds = _cache(_dataset(tmp_path, n=6), plugin, config)
    sampler = BucketSampler(ds.groups(), 2, 0, 1, seed=0)
    for mb in sampler:
        batch = ds.collate(mb)
        assert batch["latents"].shape[0] == 2 and len({ds.bucket_of(i) for i in mb}) == 1
    a, b = ds.groups()
    with pytest.raises(ValueError, match="buckets"):
        ds.collate([a[0], b[0]])


def test_model_folder_replaced_in_place_rebuilds_the_cache(setup):
    """Issue 9.1: the encoders are keyed by their files (stat, safetensors header, config content), not by
    the path string; the diffusion model's own file is not part of the key."""
    tmp_path, plugin, config, counter = setup
    toml = _dataset(tmp_path, n=4)
    _cache(toml, plugin, config)
    old = _direct(plugin, config, toml)

    counter.reset()
    write_tiny_model(config.path, seed=1)  # another model at the same path
    ds = _cache(toml, plugin, config)
    assert counter.media == 4 and len(counter.captions) == 4
    new = _direct(plugin, config, toml)
    _assert_same(rows_by_id(ds), new)
    some = next(iter(new))
    assert not torch.equal(new[some]["latents"], old[some]["latents"])

    counter.reset()  # a new transformer (the denoiser, not an encoder) keeps the cache
    write_tiny_model(tmp_path / "other", seed=2)
    os.replace(tmp_path / "other" / "transformer.safetensors", config.path / "transformer.safetensors")
    _cache(toml, plugin, config)
    assert counter.calls == 0

    counter.reset()  # an edited config file is seen even when size and mtime are kept
    cfg_file = config.path / "config.json"
    st = cfg_file.stat()
    cfg_file.write_text(cfg_file.read_text().replace("  ", " \t", 1))  # same size, same meaning, other bytes
    os.utime(cfg_file, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cfg_file.stat().st_size == st.st_size
    ds = _cache(toml, plugin, config, trust_cache=True)  # the index of another fingerprint is not trusted
    assert counter.media == 4


def test_other_fingerprints_survive_until_prune_and_a_used_one_is_never_deleted(setup):
    """Issue 9.2: two encoder settings on one dataset keep their folders; prune lists what it removes and
    keeps a folder another process holds a lease on."""
    import fcntl

    tmp_path, plugin, config, counter = setup
    toml = _dataset(tmp_path, n=2)
    root = tmp_path / "cache" / "reference" / "dataset"
    _cache(toml, plugin, config)
    (fp_a,) = [p for p in root.iterdir() if p.is_dir()]
    config_b = plugin.spec.config_schema(type="reference", path=write_tiny_model(tmp_path / "model_b", seed=1))
    _cache(toml, plugin, config_b)
    assert fp_a.is_dir() and len([p for p in root.iterdir() if p.is_dir()]) == 2

    # Another process uses fp_a: it holds a locked lease file there (the lock, not the file, is what counts).
    lease = fp_a / ".users" / "otherhost-1-test"
    fd = os.open(lease, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        ds = _cache(toml, plugin, config_b, prune=True)
        assert fp_a.is_dir() and ds.summary["pruned"] == [f"kept {fp_a} (in use by another process)"]
        with pytest.raises(Exception, match="in use by another process"):
            _cache(toml, plugin, config, regenerate=True)
        assert fp_a.is_dir()
    finally:
        os.close(fd)  # that process ends
    counter.reset()
    ds = _cache(toml, plugin, config_b, prune=True)
    assert not fp_a.exists() and counter.calls == 0
    assert len(ds.summary["pruned"]) == 1 and ds.summary["pruned"][0].startswith(f"removed {fp_a} (")


def test_items_gone_since_the_last_cache_are_said_in_one_line(setup, capsys):
    """Issue 37.4: files deleted between ``cache`` and ``train`` are named, not silently left out."""
    tmp_path, plugin, config, _ = setup
    toml = _dataset(tmp_path, n=6)
    _cache(toml, plugin, config)
    for stem in ("img_001", "img_004"):
        for file in (tmp_path / "data").glob(f"{stem}.*"):
            file.unlink()
    capsys.readouterr()
    ds = _cache(toml, plugin, config, progress=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if "gone from the dataset" in line]
    assert lines == ["diffpipe: 2 item(s) cached before are gone from the dataset (deleted or moved): "
                     "data/img_001.png, data/img_004.png; 4 items remain"], lines
    assert len(ds) == 4
    _cache(toml, plugin, config, progress=True)  # said once: the index now lists the 4
    assert "gone from the dataset" not in capsys.readouterr().err
