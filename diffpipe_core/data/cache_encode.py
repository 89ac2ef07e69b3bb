"""Encoding one rank's share of the cache: decode ahead in DataLoader workers, call the plugin's
``encode_batch``, and write the outputs in shards every few batches (so an interruption loses at most
the batches since the last shard)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from diffpipe_core.data.cache_store import write_shard
from diffpipe_core.data.items import DecodedMedia, MediaItem
from diffpipe_core.types import EncodeBatch, ModelSpec

log = logging.getLogger("diffpipe.data")


@dataclass(frozen=True)
class MediaWork:
    """One media entry to encode: its cache key and an item that produces it. For a control image of an edit pair,
    ``item`` is the control file as an item (:func:`control_work`) and ``control_index`` its number."""

    key: str
    item: MediaItem
    control_index: int | None = None


def control_work(key: str, target: MediaItem, index: int) -> MediaWork:
    """The work of encoding control image ``index`` of ``target``: the control file decoded at its own bucket,
    named after both files in error messages."""
    control = target.controls[index]
    what = "image" if control.clip_start is None else "video"
    item = MediaItem(id=f"control {what} {index} of {target.id}", path=control.path, caption="",
                     bucket=control.bucket, content_key=control.content_key, clip_start=control.clip_start,
                     paired=control.paired)
    return MediaWork(key, item, index)


class ShardBuffer:
    """Collects encoded rows and writes a shard every ``flush_batches`` batches, or earlier when a batch
    arrives whose tensors do not fit the rows already held (another shape or another set of keys)."""

    def __init__(self, table_dir: Path, prefix: str, flush_batches: int) -> None:
        self.table_dir, self.prefix, self.flush_batches = table_dir, prefix, max(1, flush_batches)
        self.keys: list[str] = []
        self.parts: dict[str, list[torch.Tensor]] = {}
        self.batches = 0
        self.shards_written = 0

    def _schema(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(v[0].shape[1:]), v[0].dtype) for k, v in self.parts.items()}

    def add(self, keys: list[str], outputs: dict[str, torch.Tensor]) -> None:
        schema = {k: (tuple(v.shape[1:]), v.dtype) for k, v in outputs.items()}
        if self.keys and schema != self._schema():
            self.flush()
        self.keys.extend(keys)
        for name, tensor in outputs.items():
            self.parts.setdefault(name, []).append(tensor.detach().to("cpu"))
        self.batches += 1
        if self.batches >= self.flush_batches:
            self.flush()

    def flush(self) -> None:
        if self.keys:
            write_shard(self.table_dir, self.prefix, self.keys, {k: torch.cat(v) for k, v in self.parts.items()})
            self.shards_written += 1
        self.keys, self.parts, self.batches = [], {}, 0


def check_outputs(outputs: Any, batch_size: int, what: str, plugin_name: str) -> dict[str, torch.Tensor]:
    """The plugin's ``encode_batch`` result, checked against the contract."""
    if not isinstance(outputs, dict) or not outputs:
        raise TypeError(f"model plugin {plugin_name!r}: encode_batch returned {type(outputs).__name__} for a "
                        f"{what} batch; expected a non-empty dict of tensors")
    for name, tensor in outputs.items():
        if not isinstance(name, str) or name.startswith("_") or name == "key":
            raise ValueError(f"model plugin {plugin_name!r}: encode_batch key {name!r} is not allowed "
                             "(keys are strings not starting with '_', and not 'key')")
        if not isinstance(tensor, torch.Tensor) or tensor.ndim == 0 or tensor.shape[0] != batch_size:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"model plugin {plugin_name!r}: encode_batch returned {name!r} with shape {shape} "
                             f"for a {what} batch of {batch_size}; every tensor needs the batch as dim 0")
    return outputs


def encode_captions(
    encode: Callable[[EncodeBatch], Any], plugin_name: str, texts: list[str], keys: list[str], batch_size: int,
    buffer: ShardBuffer, advance: Callable[[int], None],
) -> int:
    """Encode ``texts`` in batches into ``buffer``; returns how many were encoded."""
    for start in range(0, len(texts), batch_size):
        chunk = texts[start : start + batch_size]
        outputs = check_outputs(encode(EncodeBatch(captions=list(chunk))), len(chunk), "caption", plugin_name)
        buffer.add(keys[start : start + batch_size], outputs)
        advance(len(chunk))
    buffer.flush()
    return len(texts)


class _DecodeSet(TorchDataset):
    def __init__(self, work: list[MediaWork], spec: ModelSpec, load: Callable[[MediaItem, ModelSpec], Any],
                 error_type: type[Exception]) -> None:
        self.work, self.spec, self.load, self.error_type = work, spec, load, error_type

    def __len__(self) -> int:
        return len(self.work)

    def __getitem__(self, i: int) -> tuple[int, DecodedMedia | None, str | None]:
        try:
            return i, self.load(self.work[i].item, self.spec), None
        except self.error_type as exc:
            return i, None, str(exc)


class _Collate:
    """Stacks one bucket's decoded samples in the worker; failures travel alongside."""

    def __init__(self, use_masks: bool) -> None:
        self.use_masks = use_masks

    def __call__(self, samples: list[tuple[int, DecodedMedia | None, str | None]]) -> dict[str, Any]:
        ok = [(i, d) for i, d, _ in samples if d is not None]
        out: dict[str, Any] = {
            "index": [i for i, _ in ok],
            "failed": [(i, err) for i, d, err in samples if d is None],
            "pixels": None,
            "masks": None,
        }
        if ok:
            out["pixels"] = torch.stack([d.pixels for _, d in ok])
            if self.use_masks:  # an item without a mask file trains on every pixel
                out["masks"] = torch.stack([
                    d.mask if d.mask is not None else torch.ones((1, *d.pixels.shape[-2:])) for _, d in ok
                ])
            out["original_sizes"] = [tuple(d.original_size) for _, d in ok]
            out["crop_coords"] = [tuple(d.crop_coords) for _, d in ok]
            if ok[0][1].audio is not None:  # the model takes audio: every item of the batch has a waveform
                out["audio"] = torch.stack([d.audio for _, d in ok])
                out["audio_present"] = torch.tensor([d.audio_present for _, d in ok])
                out["audio_notes"] = [(i, d.audio_note) for i, d in ok if d.audio_note]
            if ok[0][1].paired:  # the items' paired files (one set of roles per batch: media_batches)
                out["paired"] = {role: [d.paired[role] for _, d in ok] for role in ok[0][1].paired}
        return out


def media_batches(work: list[MediaWork], batch_size: int) -> list[list[int]]:
    """Indices into ``work`` grouped by bucket and control number (first-seen order) and cut into batches."""
    by_bucket: dict[Any, list[int]] = {}
    for i, w in enumerate(work):
        by_bucket.setdefault((w.item.bucket, w.control_index, tuple(f.role for f in w.item.paired)), []).append(i)
    return [idx[s : s + batch_size] for idx in by_bucket.values() for s in range(0, len(idx), batch_size)]


def decoded_batches(
    work: list[MediaWork], spec: ModelSpec, batch_size: int, use_masks: bool, num_workers: int,
    load: Callable[[MediaItem, ModelSpec], Any], error_type: type[Exception], pin_memory: bool,
) -> Iterator[dict[str, Any]]:
    """Decoded, stacked batches of ``work`` in order (see :func:`media_batches`). With ``num_workers`` > 0
    the workers start decoding at once, ahead of the encoder (and of caption encoding)."""
    if not work:
        return iter(())
    loader = DataLoader(
        _DecodeSet(work, spec, load, error_type),
        batch_sampler=media_batches(work, batch_size),
        num_workers=num_workers,
        collate_fn=_Collate(use_masks),
        pin_memory=pin_memory,
        prefetch_factor=2 if num_workers > 0 else None,
    )
    return _handed_over(iter(loader))


def _handed_over(batches: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """``batches``, with a worker that died while its batch's tensors were being handed over (the connection to it
    reset or refused, before torch notices it is gone) reported as torch reports a dead worker."""
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (ConnectionError, EOFError) as exc:
            raise RuntimeError(f"DataLoader worker died while handing over a batch ({type(exc).__name__}: {exc}).") \
                from exc
        yield batch


def encode_media(
    encode: Callable[[EncodeBatch], Any], plugin_name: str, work: list[MediaWork],
    stream: Iterator[dict[str, Any]], device: torch.device, buffer: ShardBuffer, advance: Callable[[int], None],
    control_buffer: ShardBuffer | None = None, first_frames: bool = False,
) -> tuple[int, list[tuple[MediaWork, str]]]:
    """Encode the decoded batches of ``work`` into ``buffer`` (control images into ``control_buffer``); returns
    (encoded count, items that failed to decode). ``first_frames``: hand video batches their clips' first frames
    (``ModelSpec.first_frame``)."""
    encoded = 0
    failures: list[tuple[MediaWork, str]] = []
    for decoded in stream:
        for i, reason in decoded["failed"]:
            log.warning("skipping %s: %s", work[i].item.id, reason)
            failures.append((work[i], reason))
        if decoded["pixels"] is None:
            advance(len(decoded["failed"]))
            continue
        n = len(decoded["index"])
        control = work[decoded["index"][0]].control_index  # a batch is all targets or all one control number
        pixels = decoded["pixels"].to(device, non_blocking=True)
        batch = EncodeBatch(
            pixels=pixels,
            masks=None if decoded["masks"] is None or control is not None
            else decoded["masks"].to(device, non_blocking=True),
            original_sizes=decoded["original_sizes"],
            crop_coords=decoded["crop_coords"],
            control_index=control,
            first_frames=pixels[:, :, 0].contiguous() if first_frames and pixels.ndim == 5 else None,
        )
        _with_paired(batch, decoded.get("paired"), device)
        for i, note in decoded.get("audio_notes", ()):
            log.warning("%s: %s", work[i].item.id, note)
        audio = decoded.get("audio") if control is None else None
        if audio is not None:
            batch.audio = audio.to(device, non_blocking=True)
            batch.audio_present = decoded["audio_present"].to(device)
        what = "media" if control is None else f"control image {control}"
        outputs = check_outputs(encode(batch), n, what, plugin_name)
        if control is not None and control_buffer is None:
            raise ValueError("encode_media: control images to encode but no control_buffer")
        (buffer if control is None else control_buffer).add([work[i].key for i in decoded["index"]], outputs)
        encoded += n
        advance(n + len(decoded["failed"]))
    buffer.flush()
    if control_buffer is not None:
        control_buffer.flush()
    return encoded, failures


def _with_paired(batch: EncodeBatch, paired: dict[str, list[list[torch.Tensor]]] | None, device: torch.device
                 ) -> None:
    """Set the batch's paired files (``ModelSpec.paired_files``): each role's decoded files per item."""
    if not paired:
        return
    if "control_mask" in paired:
        batch.control_masks = torch.stack([m[0] for m in paired["control_mask"]]).to(device)
    if "reference" in paired:
        batch.references = [tuple(r.to(device) for r in refs) for refs in paired["reference"]]
    if "last_frame" in paired:
        batch.last_frames = [f[0].to(device) for f in paired["last_frame"]]


@dataclass(frozen=True)
class CaptionWork:
    """A caption to encode seeing its item's control images (``ModelSpec.control_in_captions``): its cache key,
    text, and the control images as work (:func:`control_work`; empty for a caption without any)."""

    key: str
    text: str
    controls: tuple[MediaWork, ...] = ()


def encode_captions_with_controls(
    encode: Callable[[EncodeBatch], Any], plugin_name: str, spec: ModelSpec, work: list[CaptionWork],
    batch_size: int, buffer: ShardBuffer, advance: Callable[[int], None],
    load: Callable[[MediaItem, ModelSpec], Any], error_type: type[Exception],
) -> list[tuple[MediaWork, str]]:
    """Encode captions with ``EncodeBatch.control_pixels``: each caption's control images, decoded here a batch at
    a time. A caption whose control image fails to decode is not encoded; returns those controls with why."""
    failures: list[tuple[MediaWork, str]] = []
    for start in range(0, len(work), batch_size):
        chunk, pixels = [], []
        for w in work[start : start + batch_size]:
            decoded: list[torch.Tensor] = []
            for c in w.controls:
                try:
                    decoded.append(load(c.item, spec).pixels)
                except error_type as exc:
                    log.warning("skipping %s: %s", c.item.id, exc)
                    failures.append((c, str(exc)))
                    break
            else:
                pixels.append(tuple(decoded))
                chunk.append(w)
        if chunk:
            batch = EncodeBatch(captions=[w.text for w in chunk], control_pixels=pixels)
            outputs = check_outputs(encode(batch), len(chunk), "caption", plugin_name)
            buffer.add([w.key for w in chunk], outputs)
        advance(min(batch_size, len(work) - start))
    buffer.flush()
    return failures
