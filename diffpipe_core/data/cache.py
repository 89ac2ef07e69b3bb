"""The content-keyed cache of latents and text embeddings, and the dataset that reads it.

Layout under ``DatasetConfig.cache_dir``::

    <model name>/<dataset TOML stem>/
        index.json                      the last prepared item list (used as is by trust_cache)
        <fingerprint[:16]>/             one folder per encoder fingerprint (plugin, version, settings)
            media/<shard>/              latents etc., one shard per few batches of one bucket
            captions/<shard>/           text embeddings
            controls/<shard>/           what encode_batch returned for control images (edit pairs)
            failed/<rank>-<id>.json     media that failed to decode (skipped until its content changes)

Every entry is keyed by content (see :mod:`diffpipe_core.data.cache_keys`); an entry whose inputs
changed simply has another key, so nothing stale is ever read. After a successful run, shards holding
no live entry are deleted unless another process uses the folder (see :mod:`diffpipe_core.data.cache_lock`);
folders of other fingerprints are deleted only by ``prune`` (``diffpipe cache --prune``), which lists them.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from diffpipe_core.data.cache_encode import (
    CaptionWork,
    MediaWork,
    ShardBuffer,
    control_work,
    decoded_batches,
    encode_captions,
    encode_captions_with_controls,
    encode_media,
)
from diffpipe_core.data.cache_fresh import plan_digest
from diffpipe_core.data.cache_keys import (
    caption_key,
    control_key,
    encoder_fingerprint,
    mask_content_key,
    media_key,
)
from diffpipe_core.data.cache_lock import encoding_turn, end_encoding_turn, gate, in_use, other_users, take_lease
from diffpipe_core.data.cache_store import Shard, list_shards, remove_temp_dirs
from diffpipe_core.data.items import Bucket, MediaItem
from diffpipe_core.data.scan_index import gc_paused
from diffpipe_core.types import AudioSpec, ModelConfigBase
from diffpipe_core.types import control_key as control_batch_key

log = logging.getLogger("diffpipe.data")

INDEX_FORMAT = 2  # 2: rows carry their [[directory]] (regularisation folders and loss weights)
DEFAULT_SHARD_BATCHES = 16


class CacheError(Exception):
    """The cache cannot serve the dataset (entries missing, incompatible tensors)."""


@dataclass(frozen=True)
class CacheEntry:
    """One dataset item as the cache sees it. ``control_keys`` and ``controls`` (their sizes) are its control
    images, in order; items are batched by bucket and control sizes (:attr:`group`)."""

    id: str
    bucket: Bucket
    repeats: int
    media_key: str
    caption_keys: tuple[str, ...]
    control_keys: tuple[str, ...] = ()
    controls: tuple[Bucket, ...] = ()
    directory: int = 0  # index of its [[directory]] (its loss weight and regularisation target)
    class_keys: tuple[str, ...] = ()  # diff_output_preservation: its class prompts' caption keys, one per variant
    paired: tuple[str, ...] = ()  # the roles of its paired files (MediaItem.paired_roles): a reference adds a frame

    @property
    def group(self) -> tuple[Bucket, tuple[Bucket, ...]] | tuple[Bucket, tuple[Bucket, ...], tuple[str, ...]]:
        """What samples of one micro-batch share: the bucket, the control images' sizes and the paired files'
        roles."""
        return (self.bucket, self.controls, self.paired) if self.paired else (self.bucket, self.controls)


@dataclass(frozen=True)
class SampleRoles:
    """Per cache entry: its ``[[directory]]``'s ``loss_weight`` and whether it trains toward the base model's own
    prediction (``regularization_target = "base"``). ``weighted``/``any_base``: whether any entry needs the trainer's
    per-sample loss at all (else every loss is the plugin's, as before)."""

    weight: np.ndarray
    base: np.ndarray
    dop: np.ndarray | None = None  # diff_output_preservation: entries with class prompts
    dop_multiplier: float = 1.0

    @property
    def weighted(self) -> bool:
        return bool((self.weight != 1.0).any()) or self.any_dop

    @property
    def any_dop(self) -> bool:
        return self.dop is not None and bool(self.dop.any())

    @property
    def any_base(self) -> bool:
        return bool(self.base.any())

    @classmethod
    def of(cls, entries: list[CacheEntry], directories: Any, dop_multiplier: float = 1.0) -> SampleRoles:
        dirs = list(directories or ())
        weight = np.array([dirs[e.directory].loss_weight if e.directory < len(dirs) else 1.0 for e in entries],
                          dtype=np.float64)
        base = np.array([dirs[e.directory].trains_toward_base if e.directory < len(dirs) else False
                         for e in entries], dtype=bool)
        dop = np.array([bool(e.class_keys) for e in entries], dtype=bool)
        return cls(weight, base, dop, float(dop_multiplier))


def caption_variants(item: MediaItem) -> tuple[str, ...]:
    """The caption texts cached for an item: its shuffled variants if the scan made any, else its caption."""
    return tuple(getattr(item, "caption_variants", ()) or ()) or (item.caption,)


def cache_root(cache_dir: Path, model_name: str, dataset_toml: Path) -> Path:
    """The cache folder of one dataset for one model."""
    return Path(cache_dir) / model_name / Path(dataset_toml).stem


# ------------------------------------------------------------------------------------------ dataset
class CachedDataset:
    """Cached samples of one dataset, indexed ``0 .. len-1`` with ``num_repeats`` expanded.

    ``collate`` stacks the cached tensors of a list of indices from one bucket; ``groups`` lists the
    indices per bucket (and control image sizes) for :class:`~diffpipe_core.data.sampler.BucketSampler`. Tensors
    are memory-mapped.
    """

    def __init__(self, entries: list[CacheEntry], fp_dir: Path, uncond_fraction: float,
                 empty_caption_key: str | None, summary: dict[str, Any] | None = None, directories: Any = (),
                 dop_multiplier: float = 1.0) -> None:
        self.entries = entries
        self.roles = SampleRoles.of(entries, directories, dop_multiplier)
        self.uncond_fraction = float(uncond_fraction)
        self.summary: dict[str, Any] = summary or {}
        self._media_shards = list_shards(fp_dir / "media")
        self._caption_shards = list_shards(fp_dir / "captions")
        media_loc = _locate(self._media_shards, {e.media_key for e in entries})
        caption_loc = _locate(self._caption_shards,
                              {k for e in entries for k in (*e.caption_keys, *e.class_keys)}
                              | ({empty_caption_key} - {None}))
        with_controls = [e for e in entries if e.control_keys]
        self._control_shards = list_shards(fp_dir / "controls") if with_controls else []
        control_loc = _locate(self._control_shards, {k for e in with_controls for k in e.control_keys})
        missing = [e.id for e in entries if e.media_key not in media_loc
                   or any(k not in caption_loc for k in (*e.caption_keys, *e.class_keys))
                   or any(k not in control_loc for k in e.control_keys)]
        if missing:
            raise CacheError(
                f"the cache in {fp_dir} lacks entries for {len(missing)} item(s), e.g. {', '.join(missing[:5])}; "
                "run caching again (without trust_cache), or with regenerate to rebuild it"
            )
        if self.uncond_fraction > 0 and (empty_caption_key is None or empty_caption_key not in caption_loc):
            raise CacheError(f"the cache in {fp_dir} has no empty-prompt embedding for uncond_fraction="
                             f"{self.uncond_fraction}; run caching again without trust_cache")
        clash = _columns(self._media_shards) & _columns(self._caption_shards)
        if clash:
            raise CacheError(f"encode_batch returned the same key(s) {sorted(clash)} for media and captions; "
                             "a plugin must name them differently")
        most = max((len(e.control_keys) for e in with_controls), default=0)
        named = {control_batch_key(k, c) for k in range(most) for c in _columns(self._control_shards)}
        clash = named & (_columns(self._media_shards) | _columns(self._caption_shards))
        if clash:
            raise CacheError(f"encode_batch returned key(s) {sorted(clash)} for media or captions, which is how "
                             "control images' tensors are named; a plugin must name them differently")
        self._media = np.array([media_loc[e.media_key] for e in entries], dtype=np.int64).reshape(-1, 2)
        self._captions = [tuple(caption_loc[k] for k in e.caption_keys) for e in entries]
        self._class_captions = [tuple(caption_loc[k] for k in e.class_keys) for e in entries]
        self._controls = [tuple(control_loc[k] for k in e.control_keys) for e in entries]
        self._empty = caption_loc.get(empty_caption_key) if empty_caption_key is not None else None
        repeats = np.array([e.repeats for e in entries], dtype=np.int64)
        self._item_of = np.repeat(np.arange(len(entries)), repeats)

    def __len__(self) -> int:
        return len(self._item_of)

    def groups(self) -> list[list[int]]:
        """Sample indices per bucket and control image sizes (sorted; indices ascending)."""
        by_group: dict[tuple, list[int]] = {}
        for index, item in enumerate(self._item_of.tolist()):
            by_group.setdefault(self.entries[item].group, []).append(index)
        return [by_group[g] for g in sorted(by_group)]

    def bucket_of(self, index: int) -> Bucket:
        return self.entries[int(self._item_of[index])].bucket

    def sample_roles(self, indices: list[int]) -> tuple[list[float], list[bool]]:
        """The samples' loss weights and whether each trains toward the base model's prediction
        (:class:`SampleRoles`)."""
        items = [int(self._item_of[i]) for i in indices]
        return [float(self.roles.weight[i]) for i in items], [bool(self.roles.base[i]) for i in items]

    def sample_dop(self, indices: list[int]) -> list[bool]:
        """Whether each sample has a class prompt (``diff_output_preservation``)."""
        dop = self.roles.dop
        return [bool(dop[int(self._item_of[i])]) if dop is not None else False for i in indices]

    def sample_ids(self, indices: list[int]) -> list[str]:
        """The items' ids (file path, ``#clip`` for video clips), for error messages."""
        return [self.entries[int(self._item_of[i])].id for i in indices]

    def collate(
        self, indices: list[int], generator: torch.Generator | None = None, uncond: bool = False,
        class_prompt: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Stacked tensors of the given samples: every media and caption key the plugin returned, and the tensors
        of the ``k``-th control image as ``control_<k>_<key>`` (:func:`diffpipe_core.types.control_key`).

        Random choices (caption dropout with probability ``uncond_fraction``, and which cached caption
        variant) come from ``generator``, two uniform draws per sample whatever the data, so equal
        generators give equal batches. ``uncond``: every caption is the empty prompt (``[model] cfg``'s
        unconditional pass), the draws made all the same. ``class_prompt``: each item's class prompt
        (``diff_output_preservation``; the same variant as its caption would be; items without one keep their caption),
        never dropped.
        """
        if not indices:
            raise ValueError("collate: empty list of indices")
        n = len(indices)
        drop = torch.rand(n, generator=generator) < self.uncond_fraction
        if uncond:
            if self._empty is None:
                raise CacheError("the cache has no empty-prompt embedding for [model] cfg; run caching again")
            drop = torch.ones_like(drop)
        pick = torch.rand(n, generator=generator)
        items = [int(self._item_of[i]) for i in indices]
        groups = {self.entries[i].group for i in items}
        if len(groups) > 1:
            shown = ", ".join(str(b) + "".join(f"+control {c}" for c in cs) for b, cs, *_ in sorted(groups))
            raise ValueError(f"collate: samples from {len(groups)} buckets ({shown}) "
                             f"cannot be stacked: {', '.join(self.sample_ids(indices))}")
        media = [tuple(self._media[i]) for i in items]
        captions = []
        for j, i in enumerate(items):
            if class_prompt and self._class_captions[i]:
                options = self._class_captions[i]
                captions.append(options[min(int(pick[j] * len(options)), len(options) - 1)])
            elif drop[j] and not class_prompt:
                captions.append(self._empty)
            else:
                options = self._captions[i]
                captions.append(options[min(int(pick[j] * len(options)), len(options) - 1)])
        out = _gather(self._media_shards, media, self.sample_ids(indices))
        out.update(_gather(self._caption_shards, captions, self.sample_ids(indices)))
        for k in range(len(self._controls[items[0]])):
            part = _gather(self._control_shards, [self._controls[i][k] for i in items], self.sample_ids(indices))
            out.update({control_batch_key(k, name): tensor for name, tensor in part.items()})
        return out


def needs_empty_prompt(dataset: Any, model_config: Any) -> bool:
    """Whether the cache holds the empty prompt's embedding: for caption dropout (``uncond_fraction``) or for the
    unconditional pass of CFG-augmented training (``[model] cfg``)."""
    return dataset.uncond_fraction > 0 or getattr(model_config, "cfg", None) is not None


def _locate(shards: list[Shard], wanted: set[str]) -> dict[str, tuple[int, int]]:
    loc: dict[str, tuple[int, int]] = {}
    for s, shard in enumerate(shards):
        for row, key in enumerate(shard.keys):
            if key in wanted:
                loc[key] = (s, row)
    return loc


def _columns(shards: list[Shard]) -> set[str]:
    return {c for shard in shards for c in shard.columns}


def _gather(shards: list[Shard], locs: list[tuple[int, int]], ids: list[str]) -> dict[str, torch.Tensor]:
    """Rows from several shards, stacked in the order of ``locs`` (filled in numpy: small copies there
    cost microseconds, torch's indexing costs more)."""
    by_shard: dict[int, list[int]] = {}
    for pos, (s, _) in enumerate(locs):
        by_shard.setdefault(int(s), []).append(pos)
    first = shards[next(iter(by_shard))]
    columns = first.columns
    out = {name: np.empty((len(locs), *array.shape[1:]), dtype=array.dtype) for name, array in first.arrays().items()}
    for s, positions in by_shard.items():
        shard = shards[s]
        if shard.columns != columns:
            raise CacheError(f"cached tensors of {', '.join(ids)} differ in keys or shapes and cannot be stacked")
        rows = [int(locs[p][1]) for p in positions]
        for name, array in shard.arrays().items():
            out[name][positions] = array[rows]
    return {name: _to_torch(array, columns[name][1]) for name, array in out.items()}


def _to_torch(array: np.ndarray, dtype: str) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


# ------------------------------------------------------------------------------------------ caching
def prepare_cache(
    dataset_toml: Path,
    plugin: Any,
    model_config: ModelConfigBase,
    *,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] = lambda: None,
    device: torch.device = torch.device("cpu"),
    batch_size: int = 4,
    regenerate: bool = False,
    strict: bool = False,
    trust_cache: bool = False,
    progress: bool = True,
    decode_workers: int | None = None,
    shard_batches: int = DEFAULT_SHARD_BATCHES,
    prune: bool = False,
    report_skipped: bool = True,
) -> CachedDataset:
    """Scan the dataset, encode what the cache lacks (this rank's share), and open the whole cache.

    Args:
        dataset_toml: the dataset TOML.
        plugin: the model plugin (:class:`~diffpipe_core.registry.ModelPlugin`).
        model_config: its validated ``[model]`` config; the keys in ``plugin.spec.encoder_settings``
            are part of every cache key.
        rank / world_size / barrier: every rank encodes a disjoint round-robin share of the missing
            entries; ``barrier`` must block until all ranks reach it (e.g. ``torch.distributed.barrier``).
            All ranks must see the same cache folder.
        device: where the encoders run.
        batch_size: samples per ``encode_batch`` call.
        regenerate: discard this dataset's cache and encode everything.
        strict: key media by a hash of their bytes instead of size + mtime.
        trust_cache: open the stored index without scanning the files (falls back to a scan if the
            index is missing or was made with other encoder settings).
        progress: show a progress bar and summary line (rank 0).
        decode_workers: DataLoader workers decoding ahead of the encoder (default:
            ``$DIFFPIPE_DECODE_WORKERS`` or ``min(4, cpus - 1)``).
        shard_batches: batches per shard file; an interrupted run keeps every finished shard.
        prune: after caching, delete (and list) the folders of other encoder fingerprints that no live
            process is using; ``summary["pruned"]`` lists them.
        report_skipped: warn (on rank 0) about each file the scan leaves out; False when the command's own
            scan already did.
    """
    from diffpipe_core.data.dataset_config import load_dataset_config
    from diffpipe_core.model_files import model_file_problems

    start = time.perf_counter()
    show = progress and rank == 0
    dataset_toml = Path(dataset_toml)
    cfg = load_dataset_config(dataset_toml)
    spec = plugin.spec
    wrong = model_file_problems(plugin, model_config)
    if wrong:  # before anything is encoded with encoders built from the wrong files
        raise CacheError("the model files do not fit model " + repr(plugin.name) + ":\n  " + "\n  ".join(wrong))
    fingerprint = encoder_fingerprint(plugin.name, plugin.version, model_config, tuple(spec.encoder_settings),
                                      strict=strict)
    audio = model_audio(plugin, model_config)
    root = cache_root(cfg.cache_dir, plugin.name, dataset_toml)
    fp_dir = root / fingerprint[:16]
    index_path = root / "index.json"
    empty_key = caption_key("", fingerprint) if needs_empty_prompt(cfg, model_config) else None
    if rank == 0:  # one lease per run: the other ranks end with rank 0
        with gate(root):
            take_lease(fp_dir)

    if trust_cache and not regenerate and not prune:
        index = _read_index(index_path, fingerprint)
        if index is not None and index["plan_inputs"] != dop_inputs(cfg):
            log.warning("trust_cache: the cache index was made with other diff_output_preservation settings; "
                        "checking every file instead")
        elif index is not None:
            entries = index["entries"]
            summary = _summary(entries, 0, 0, len({e.media_key for e in entries}),
                               len({k for e in entries for k in e.caption_keys}), index["skipped"], start)
            try:
                dataset = CachedDataset(entries, fp_dir, cfg.uncond_fraction, empty_key, summary, cfg.directory,
                                        cfg.diff_output_preservation_multiplier)
            except CacheError as exc:
                log.warning("trust_cache: %s; checking every file instead", exc)
            else:
                summary["seconds"] = round(time.perf_counter() - start, 3)
                _report(summary, show)
                return dataset
        else:
            log.warning("%s: no cache index for these encoder settings; checking every file", index_path)

    if regenerate:
        busy: list[str] = []
        if rank == 0:
            with gate(root):
                busy = other_users(fp_dir)
                if not busy:
                    shutil.rmtree(fp_dir, ignore_errors=True)
                    index_path.unlink(missing_ok=True)
                    take_lease(fp_dir)
        barrier()
        if busy:
            raise CacheError(f"{fp_dir} is in use by another process ({', '.join(busy)}); regenerating would "
                             "delete its cache. Wait for it to finish, or run without regenerate")

    # -- plan: the same on every rank, made before any rank writes
    from diffpipe_core.data.scan import scan_dataset

    if rank != 0:
        barrier()  # rank 0 scans first and updates the scan index; the other ranks then only stat the files
    scan = scan_dataset(cfg, spec, strict=strict, progress=show, report_skipped=report_skipped and rank == 0)
    if rank == 0:
        barrier()
    dop = [dop_inputs(cfg)] if cfg.diff_output_preservation else []  # off: the plan of a cache made before DOP
    sound = [("audio", audio.sample_rate, audio.channels, audio.damaged)] if audio is not None else []
    plan = plan_digest(scan, fingerprint, strict, empty_key, *dop, *sound)
    fresh = None if regenerate or prune else _open_if_fresh(index_path, fingerprint, plan, fp_dir, cfg.uncond_fraction,
                                                             empty_key, start, cfg.directory,
                                                             cfg.diff_output_preservation_multiplier)
    if fresh is not None:  # nothing changed since the index was written (the same on every rank)
        for _ in range(4):  # as many barriers as the caching path below, so that ranks stay in step regardless
            barrier()
        _report(fresh.summary, show)
        return fresh
    use_masks = any(item.mask_path is not None for item in scan.items)
    entries: list[CacheEntry] = []
    first_item: dict[str, MediaItem] = {}
    first_control: dict[str, tuple[MediaItem, int]] = {}  # control key -> (a target that has it, its number)
    texts: dict[str, str] = {}
    seen_by_caption: dict[str, tuple[str, ...]] = {}  # caption key -> the control keys its encoding sees
    for item in scan.items:
        key = media_key(item, mask_content_key(item, use_masks, strict), fingerprint, spec.first_frame != "none",
                        audio)
        first_item.setdefault(key, item)
        controls = tuple(control_key(c, k, fingerprint) for k, c in enumerate(item.controls))
        for k, ck in enumerate(controls):
            first_control.setdefault(ck, (item, k))
        seen = controls if spec.control_in_captions else ()
        variants = caption_variants(item)
        keys = tuple(caption_key(t, fingerprint, seen) for t in variants)
        texts.update(zip(keys, variants))
        class_keys: tuple[str, ...] = ()
        if cfg.diff_output_preservation and not cfg.directory[item.directory].regularization:
            class_texts = [cfg.class_prompt(t) for t in variants]
            class_keys = tuple(caption_key(t, fingerprint, seen) for t in class_texts)
            texts.update(zip(class_keys, class_texts))
            seen_by_caption.update(dict.fromkeys(class_keys, seen) if seen else {})
        seen_by_caption.update(dict.fromkeys(keys, seen) if seen else {})
        entries.append(CacheEntry(item.id, item.bucket, item.repeats, key, keys, controls,
                                  tuple(c.bucket for c in item.controls), item.directory, class_keys,
                                  item.paired_roles()))
    if empty_key is not None:
        texts[empty_key] = ""

    if rank == 0:  # another run encoding into this folder goes first; what it encodes is then reused
        encoding_turn(fp_dir, lambda line: log.warning("%s", line))
    barrier()
    cached_media = {k for shard in list_shards(fp_dir / "media") for k in shard.keys}
    cached_captions = {k for shard in list_shards(fp_dir / "captions") for k in shard.keys}
    cached_controls = {k for shard in list_shards(fp_dir / "controls") for k in shard.keys} if first_control else set()
    failed = _read_failures(fp_dir / "failed")
    todo_media = [k for k in first_item if k not in cached_media and k not in failed]
    known_bad = sum(1 for k in first_item if k in failed)  # failed before, content unchanged: not retried
    todo_captions = [k for k in texts if k not in cached_captions]
    todo_controls = [k for k in first_control if k not in cached_controls and k not in failed]
    barrier()

    # -- encode this rank's share
    my_media = [MediaWork(k, first_item[k]) for k in todo_media[rank::world_size]]
    my_controls = [control_work(k, *first_control[k]) for k in todo_controls[rank::world_size]]
    my_captions = todo_captions[rank::world_size]
    caption_work = None
    if spec.control_in_captions:  # caption batches carry their items' control images
        caption_work = [CaptionWork(k, texts[k], tuple(control_work(c, *first_control[c])
                                                       for c in seen_by_caption.get(k, ()))) for k in my_captions]
    encoded_media, new_failures = 0, []
    if my_media or my_captions or my_controls:
        encoded_media, new_failures = _encode_share(
            plugin, model_config, spec, fp_dir, rank, my_media, my_captions, texts, use_masks, device,
            batch_size, shard_batches, _workers(decode_workers), show, my_controls, caption_work, audio,
        )
    barrier()

    # -- rank 0 tidies up and records the index; then everyone opens the whole cache
    failed = _read_failures(fp_dir / "failed")
    skipped = [(str(s.path), s.reason) for s in scan.skipped]
    skipped += [(str(first_item[k].path), failed[k]) for k in first_item if k in failed]
    for item, entry in zip(scan.items, entries):  # a control image that failed to decode leaves its target out
        bad = [k for k in entry.control_keys if k in failed]
        if bad and entry.media_key not in failed:
            reason = f"unreadable control: {failed[bad[0]]}"
            if (str(item.path), reason) not in skipped:
                skipped.append((str(item.path), reason))
    entries = [e for e in entries if e.media_key not in failed and not any(k in failed for k in e.control_keys)]
    pruned: list[str] = []
    if rank == 0:
        pruned = _collect_garbage(root, fp_dir, set(first_item), set(texts), prune, set(first_control))
        gone = gone_since_index(index_path, fingerprint, entries, Path(dataset_toml).parent)
        if gone:
            shown = ", ".join(gone[:3]) + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
            line = (f"diffpipe: {len(gone)} item(s) cached before are gone from the dataset (deleted or moved): "
                    f"{shown}; {len(entries)} items remain")
            if show:
                tqdm.write(line, file=sys.stderr)
            else:
                log.info(line)
        _write_index(index_path, fingerprint, entries, skipped, plan, dop_inputs(cfg))
        end_encoding_turn(fp_dir)
    barrier()
    if not entries:
        raise CacheError(f"{dataset_toml}: every item failed to decode; see the warnings above")
    reused_media = len(first_item) - len(todo_media) - known_bad
    reused_captions = len(texts) - len(todo_captions)
    summary = _summary(entries, encoded_media, len(my_captions), reused_media, reused_captions, skipped, start)
    summary["encoded_media_all_ranks"] = len(todo_media) - len([k for k in todo_media if k in failed])
    summary["encoded_captions_all_ranks"] = len(todo_captions)
    summary["encoded_controls"] = len(todo_controls) - len([k for k in todo_controls if k in failed])
    summary["reused_controls"] = len(first_control) - len(todo_controls) - sum(
        1 for k in first_control if k in failed and k not in todo_controls)
    summary["decode_failures"] = len(new_failures)
    summary["pruned"], summary["prune"] = pruned, prune
    dataset = CachedDataset(entries, fp_dir, cfg.uncond_fraction, empty_key, summary, cfg.directory,
                                        cfg.diff_output_preservation_multiplier)
    summary["seconds"] = round(time.perf_counter() - start, 3)
    _report(summary, show)
    return dataset


def open_cached(dataset_toml: Path, plugin: Any, model_config: ModelConfigBase) -> CachedDataset | None:
    """The dataset's cache for these encoder settings as its index last listed it, read only (no scan, no lease,
    nothing encoded), or None when there is none yet or it lacks entries. For reports (``diffpipe validate`` and
    ``data`` estimate activations from cached shapes), never for training."""
    from diffpipe_core.data.dataset_config import load_dataset_config

    cfg = load_dataset_config(Path(dataset_toml))
    fingerprint = encoder_fingerprint(plugin.name, plugin.version, model_config, tuple(plugin.spec.encoder_settings))
    root = cache_root(cfg.cache_dir, plugin.name, Path(dataset_toml))
    index = _read_index(root / "index.json", fingerprint)
    if index is None or not index["entries"]:
        return None
    empty_key = caption_key("", fingerprint) if needs_empty_prompt(cfg, model_config) else None
    try:
        return CachedDataset(index["entries"], root / fingerprint[:16], cfg.uncond_fraction, empty_key,
                             directories=cfg.directory, dop_multiplier=cfg.diff_output_preservation_multiplier)
    except CacheError:
        return None


def model_audio(plugin: Any, model_config: ModelConfigBase) -> AudioSpec | None:
    """The model's :class:`~diffpipe_core.types.AudioSpec` (its optional ``audio_spec`` hook), None when it takes no
    audio."""
    audio = plugin.call("audio_spec", model_config=model_config)
    if audio is not None and not isinstance(audio, AudioSpec):
        raise TypeError(f"model plugin {plugin.name!r}: audio_spec returned {type(audio).__name__}; expected an "
                        "AudioSpec or None")
    return audio


def _workers(requested: int | None) -> int:
    if requested is not None:
        return max(0, requested)
    env = os.environ.get("DIFFPIPE_DECODE_WORKERS")
    if env:
        return max(0, int(env))
    return max(0, min(4, (os.cpu_count() or 1) - 1))


def _encode_share(plugin: Any, model_config: ModelConfigBase, spec: Any, fp_dir: Path, rank: int,
                  my_media: list[MediaWork], my_captions: list[str], texts: dict[str, str], use_masks: bool,
                  device: torch.device, batch_size: int, shard_batches: int, workers: int,
                  show: bool, my_controls: list[MediaWork] | None = None,
                  caption_work: list[CaptionWork] | None = None,
                  audio: AudioSpec | None = None) -> tuple[int, list[tuple[MediaWork, str]]]:
    """Load the encoders, encode captions then media (targets and control images), write failures; always free
    the encoders. ``caption_work``: the captions as :class:`CaptionWork` when their encoding sees control images.
    Returns the number of target media encoded and every failure."""
    from diffpipe_core.data.decode import MediaError, load_media

    # Held in a dict so that clearing it drops the only reference, whatever closures exist.
    held = {"encoders": plugin.require("load_encoders", model_config=model_config, device=device)}
    my_controls = my_controls or []
    # the bar counts encodings: each item's media, caption and control images are encoded apart (rank 0's share)
    controls = f" + {len(my_controls)} control images" if my_controls else ""
    bar = tqdm(total=len(my_media) + len(my_captions) + len(my_controls), unit="encoding",
               desc=f"caching {len(my_media)} media + {len(my_captions)} captions{controls}", disable=not show,
               dynamic_ncols=True)
    prefix = f"r{rank:03d}-{time.time_ns()}"
    stream = None
    try:
        def encode(batch: Any) -> Any:
            return plugin.require("encode_batch", encoders=held["encoders"], batch=batch)

        # Decoding workers start now and run ahead while the captions are encoded.
        work = my_media + my_controls
        load = partial(load_media, audio=audio) if audio is not None else load_media
        stream = decoded_batches(work, spec, batch_size, use_masks, workers, load, MediaError,
                                 device.type == "cuda")
        captions = ShardBuffer(fp_dir / "captions", prefix, shard_batches)
        failures: list[tuple[MediaWork, str]] = []
        if caption_work is None:
            encode_captions(encode, plugin.name, [texts[k] for k in my_captions], my_captions, batch_size, captions,
                            bar.update)
        else:
            failures += encode_captions_with_controls(encode, plugin.name, spec, caption_work, batch_size, captions,
                                                      bar.update, load_media, MediaError)
        encoded, stream_failures = encode_media(
            encode, plugin.name, work, stream, device, ShardBuffer(fp_dir / "media", prefix, shard_batches),
            bar.update, ShardBuffer(fp_dir / "controls", prefix, shard_batches), spec.first_frame != "none")
        failures += stream_failures
        if failures:
            _write_failures(fp_dir / "failed", prefix, {w.key: reason for w, reason in failures})
        encoded_controls = len(my_controls) - sum(1 for w, _ in stream_failures if w.control_index is not None)
        return encoded - encoded_controls, failures
    finally:
        bar.close()
        del stream  # shuts decode workers down, also after an error
        held.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ records
def _summary(entries: list[CacheEntry], encoded_media: int, encoded_captions: int, reused_media: int,
             reused_captions: int, skipped: list[tuple[str, str]], start: float) -> dict[str, Any]:
    return {
        "items": len(entries),
        "samples": sum(e.repeats for e in entries),
        "encoded_media": encoded_media,
        "encoded_captions": encoded_captions,
        "reused_media": reused_media,
        "reused_captions": reused_captions,
        "encoded_controls": 0,  # control images of edit pairs; the caching path sets both
        "reused_controls": len({k for e in entries for k in e.control_keys}),
        "skipped": len(skipped),
        "skipped_files": [{"path": p, "reason": r} for p, r in skipped],
        "seconds": round(time.perf_counter() - start, 3),
    }


def _report(summary: dict[str, Any], show: bool) -> None:
    # totals over all ranks where known, so the line rank 0 prints describes the whole cache
    media = summary.get("encoded_media_all_ranks", summary["encoded_media"])
    captions = summary.get("encoded_captions_all_ranks", summary["encoded_captions"])
    line = (f"cache: {summary['items']} items ({summary['samples']} samples) | media encoded "
            f"{media}, reused {summary['reused_media']} | captions encoded "
            f"{captions}, reused {summary['reused_captions']} | "
            + (f"control images encoded {summary['encoded_controls']}, reused {summary['reused_controls']} | "
               if summary.get("encoded_controls") or summary.get("reused_controls") else "")
            + f"skipped {summary['skipped']} | {summary['seconds']:.1f} s")
    pruned = summary.get("pruned")
    if pruned is not None and summary.get("prune"):
        line += "".join(f"\ncache --prune: {p}" for p in pruned) or "\ncache --prune: no other encoder fingerprints"
    if show:
        tqdm.write(line, file=sys.stderr)
    else:
        log.info(line)


def _atomic_write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _write_failures(folder: Path, prefix: str, failures: dict[str, str]) -> None:
    _atomic_write_json(folder / f"{prefix}-{uuid.uuid4().hex[:8]}.json", failures)


def _read_failures(folder: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    if folder.is_dir():
        for path in sorted(folder.glob("*.json")):
            if not path.name.startswith("."):
                out.update(json.loads(path.read_text()))
    return out


def dop_inputs(cfg: Any) -> list[Any] | None:
    """What of the dataset TOML the class prompts of ``diff_output_preservation`` depend on (None when it is off):
    part of the cache plan, and recorded in the index for ``trust_cache``."""
    if not cfg.diff_output_preservation:
        return None
    return [cfg.trigger_word, cfg.diff_output_preservation_class, [d.regularization for d in cfg.directory]]


def _write_index(path: Path, fingerprint: str, entries: list[CacheEntry], skipped: list[tuple[str, str]],
                 plan: str | None = None, dop: list[Any] | None = None) -> None:
    rows = [[e.id, e.bucket.width, e.bucket.height, e.bucket.frames, e.repeats, e.media_key, list(e.caption_keys)]
            + ([list(e.control_keys), [_size(c) for c in e.controls]] if e.control_keys else [])
            + ([{"directory": e.directory, "class": list(e.class_keys), **({"paired": list(e.paired)} if e.paired
                                                                             else {})}]
               if e.directory or e.class_keys or e.paired else [])
            for e in entries]
    _atomic_write_json(path, {"format": INDEX_FORMAT, "fingerprint": fingerprint, "plan": plan, "entries": rows,
                              "skipped": [list(s) for s in skipped], "dop": dop})


def _size(bucket: Bucket) -> list[int]:
    """A control's bucket in the index: ``[width, height]``, and its frames for a control video."""
    return [bucket.width, bucket.height, *([bucket.frames] if bucket.frames > 1 else [])]


def gone_since_index(path: Path, fingerprint: str, entries: list[CacheEntry], anchor: Path) -> list[str]:
    """The items the cache's index listed that ``entries`` (the new plan) lacks because their file is gone: deleted
    or moved since the last ``cache`` or ``train``, so the user hears of it rather than training on fewer items.
    Item ids are file paths relative to ``anchor`` (the dataset TOML's folder), with ``#clip`` / ``@WxH`` tails."""
    try:
        index = _read_index(path, fingerprint)
    except (AttributeError, KeyError, TypeError, ValueError):
        return []
    if index is None:
        return []
    now = {e.id for e in entries}
    return [e.id for e in index["entries"]
            if e.id not in now and not (anchor / re.sub(r"(#\d+)?(@\d+x\d+)?$", "", e.id)).exists()]


def _read_index(path: Path, fingerprint: str) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("format") != INDEX_FORMAT or data.get("fingerprint") != fingerprint:
        return None
    entries = [CacheEntry(i, Bucket(w, h, f), r, m, tuple(c), *_controls(rest)) for i, w, h, f, r, m, c, *rest
               in data["entries"]]
    return {"entries": entries, "skipped": [tuple(s) for s in data["skipped"]], "plan": data.get("plan"),
            "plan_inputs": data.get("dop")}


def _controls(rest: list) -> tuple[tuple[str, ...], tuple[Bucket, ...], int, tuple[str, ...], tuple[str, ...]]:
    """An index row's control keys and sizes (rows of items without control images have none), its
    ``[[directory]]``, its class prompts' keys and its paired files' roles (a trailing ``{"directory": n, "class":
    [...], "paired": [...]}``, absent for 0 and none)."""
    extra = rest.pop() if rest and isinstance(rest[-1], dict) else {}
    directory, class_keys = extra.get("directory", 0), tuple(extra.get("class", ()))
    paired = tuple(extra.get("paired", ()))
    if not rest:
        return (), (), directory, class_keys, paired
    keys, sizes = rest
    return tuple(keys), tuple(Bucket(*size) for size in sizes), directory, class_keys, paired


def _open_if_fresh(index_path: Path, fingerprint: str, plan: str, fp_dir: Path, uncond_fraction: float,
                   empty_key: str | None, start: float, directories: Any = (),
                   dop_multiplier: float = 1.0) -> CachedDataset | None:
    """The cache as its index lists it, if the index was written for this very plan (same scan, same
    encoders: :mod:`diffpipe_core.data.cache_fresh`) and every entry is in the shards; else None."""
    try:
        with gc_paused():  # 100,000 entries: many small objects, no cycles
            index = _read_index(index_path, fingerprint)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:  # damaged by hand: plan and rewrite it
        log.warning("%s is damaged (%s: %s); checking every entry", index_path, type(exc).__name__, exc)
        return None
    if index is None or index["plan"] != plan:
        return None
    entries = index["entries"]
    summary = _summary(entries, 0, 0, len({e.media_key for e in entries}),
                       len({k for e in entries for k in e.caption_keys}), index["skipped"], start)
    try:
        with gc_paused():
            dataset = CachedDataset(entries, fp_dir, uncond_fraction, empty_key, summary, directories,
                                     dop_multiplier)
    except CacheError as exc:  # shards deleted by hand: cache what is missing
        log.warning("%s; encoding what is missing", exc)
        return None
    summary["seconds"] = round(time.perf_counter() - start, 3)
    return dataset


def _collect_garbage(root: Path, fp_dir: Path, live_media: set[str], live_captions: set[str],
                     prune: bool, live_controls: set[str] | None = None) -> list[str]:
    """Delete shards without a live entry, stale failure records and temp folders, unless another process
    uses this fingerprint's folder; with ``prune`` also the folders of other fingerprints that no process
    uses. Runs on rank 0 between barriers. Returns one line per pruned or kept folder."""
    report: list[str] = []
    with gate(root):
        if prune:
            for path in sorted(root.iterdir()):
                if not path.is_dir() or path.resolve() == fp_dir.resolve() or path.name.startswith("."):
                    continue
                if in_use(path):
                    report.append(f"kept {path} (in use by another process)")
                    continue
                size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                shutil.rmtree(path, ignore_errors=True)
                report.append(f"removed {path} ({size / 2**20:.1f} MiB, another encoder fingerprint)")
        for path in root.iterdir():
            if path.name.startswith(".tmp-"):
                path.unlink(missing_ok=True)
        if in_use(fp_dir):
            return report
        _remove_dead_shards(fp_dir, live_media, live_captions, live_controls or set())
    return report


def _remove_dead_shards(fp_dir: Path, live_media: set[str], live_captions: set[str],
                        live_controls: set[str] | None = None) -> None:
    live_controls = live_controls or set()
    for table, live in (("media", live_media), ("captions", live_captions), ("controls", live_controls)):
        remove_temp_dirs(fp_dir / table)
        for shard in list_shards(fp_dir / table):
            if not live.intersection(shard.keys):
                shutil.rmtree(shard.path, ignore_errors=True)
    folder = fp_dir / "failed"
    if folder.is_dir():
        for path in folder.iterdir():
            recorded = json.loads(path.read_text()) if not path.name.startswith(".") else {}
            if not (live_media.intersection(recorded) or live_controls.intersection(recorded)):
                path.unlink(missing_ok=True)
