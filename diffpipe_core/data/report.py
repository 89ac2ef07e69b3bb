"""The ``diffpipe data`` report: buckets, micro-batches per epoch, and every file left out with why."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from diffpipe_core.data.items import Bucket, ScanResult
from diffpipe_core.data.scan import reason_category

CROP_WARN = 0.2  # items cropped by more than this share of their area are counted in the report


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def bucket_counts(scan: ScanResult) -> dict[Bucket, int]:
    """Samples per epoch in each bucket (each item counted ``repeats`` times), sorted by bucket."""
    counts: dict[Bucket, int] = defaultdict(int)
    for item in scan.items:
        counts[item.bucket] += item.repeats
    return dict(sorted(counts.items()))


def _group(item: Any) -> tuple:
    """An item's micro-batch group: bucket, control image sizes (edit pairs batch apart) and paired files' roles."""
    return item.bucket, tuple(c.bucket for c in item.controls), item.paired_roles()


def group_counts(scan: ScanResult) -> dict[tuple, int]:
    """Samples per epoch in each micro-batch group: bucket, control image sizes (edit pairs batch apart) and the
    paired files' roles (``ModelSpec.paired_files``: items with and without reference images batch apart)."""
    counts: dict[tuple, int] = defaultdict(int)
    for item in scan.items:
        counts[_group(item)] += item.repeats
    return dict(sorted(counts.items()))


def sound_counts(scan: ScanResult) -> dict[tuple, int]:
    """Samples per epoch with sound (a video with an audio track) in each micro-batch group of :func:`group_counts`."""
    counts: dict[tuple, int] = defaultdict(int)
    for item in scan.items:
        if item.has_audio:
            counts[_group(item)] += item.repeats
    return dict(counts)


PAIRED_COLUMNS = {"control_mask": "with control mask", "reference": "with references", "last_frame": "with last frame"}


def paired_counts(scan: ScanResult) -> dict[str, dict[tuple, int]]:
    """Per paired-file role (``ModelSpec.paired_files``) that any item has: samples per epoch having such a file in
    each micro-batch group of :func:`group_counts`."""
    counts: dict[str, dict[tuple, int]] = {}
    for item in scan.items:
        for role in dict.fromkeys(item.paired_roles()):
            per = counts.setdefault(role, defaultdict(int))
            per[_group(item)] += item.repeats
    return {role: dict(counts[role]) for role in PAIRED_COLUMNS if role in counts}


def regularization_lines(scan: ScanResult, dataset: Any) -> list[str]:
    """One line per ``[[directory]]`` that is a regularisation folder or has a ``loss_weight`` other than 1: its items
    per epoch (repeats counted), what they train toward and their weight; empty when there is none. ``dataset``: the
    :class:`~diffpipe_core.data.dataset_config.DatasetConfig` ``scan`` was made from."""
    dirs = list(getattr(dataset, "directory", None) or ())
    shown = [i for i, d in enumerate(dirs) if d.regularization or d.loss_weight != 1.0]
    dop = bool(getattr(dataset, "diff_output_preservation", False))
    if not shown and not dop:
        return []
    per_dir: dict[int, int] = defaultdict(int)
    for item in scan.items:
        per_dir[item.directory] += item.repeats
    lines = ["Regularisation and loss weights:"]
    for i in shown:
        d = dirs[i]
        if d.regularization:
            target = d.regularization_target or "captions"
            what = ("regularisation, toward the base model's own prediction (one extra forward without gradient per "
                    "micro-batch holding such items)" if target == "base" else
                    "regularisation, toward their captions' ordinary target")
        else:
            what = "training items"
        lines.append(f"  directory[{i}] ({d.path}): {_n(per_dir.get(i, 0), 'sample')} per epoch, {what}, "
                     f"loss_weight {d.loss_weight:g}")
    regular = sum(n for i, n in per_dir.items() if i >= len(dirs) or not dirs[i].regularization)
    lines.append(f"  training (not regularisation) samples per epoch: {regular}")
    if dop:
        with_trigger = sum(1 for item in scan.items if not dirs[item.directory].regularization
                           and dataset.trigger_word in item.caption)
        training = sum(1 for item in scan.items if not dirs[item.directory].regularization)
        lines.append(f"  diff_output_preservation: class prompts replace {dataset.trigger_word!r} by "
                     f"{dataset.diff_output_preservation_class!r} ({with_trigger} of {training} training items' "
                     f"captions hold it), multiplier {dataset.diff_output_preservation_multiplier:g}; each "
                     "micro-batch also trains its class prompts (twice the samples) after one more forward without "
                     "gradient")
    return lines


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        )

    return [fmt(header), "  ".join("-" * w for w in widths), *(fmt(r).rstrip() for r in rows)]


def format_report(
    scan: ScanResult, micro_batch_size: int | Callable[[Bucket], int], dp_world_size: int, dataset: Any = None
) -> str:
    """A plain-text report: one row per bucket (size, frames, the control images' sizes of an edit dataset, samples
    per epoch including repeats, how many of them have sound (a video with an audio track; the column shows when any
    has), its micro-batch size, micro-batches per epoch on each data-parallel rank, and the
    remainder that cannot fill a global micro-batch of ``micro_batch_size * dp_world_size``), then every skipped
    file and a summary. ``micro_batch_size`` is one size or a function of the bucket (per-resolution sizes). With
    ``dataset`` (its config) the regularisation folders and loss weights are listed too
    (:func:`regularization_lines`)."""
    size_of = micro_batch_size if callable(micro_batch_size) else (lambda bucket: micro_batch_size)
    per_bucket = callable(micro_batch_size)
    groups = group_counts(scan)
    counts = bucket_counts(scan)
    edits = any(controls for _, controls, _ in groups)
    sound = sound_counts(scan)
    paired = paired_counts(scan)
    rows = []
    total_batches = total_rest = 0
    empty = []
    for group, n in groups.items():
        bucket, controls, _ = group
        size = size_of(bucket)
        batches, rest = divmod(n, size * dp_world_size)
        total_batches += batches
        total_rest += rest
        if batches == 0:
            empty.append(str(bucket) + "".join(f" + control {c}" for c in controls))
        row = [f"{bucket.width}x{bucket.height}", str(bucket.frames)]
        row += [" + ".join(f"{c.width}x{c.height}" for c in controls) or "-"] if edits else []
        rows.append([*row, str(n), *([str(sound.get(group, 0))] if sound else []),
                     *(str(per.get(group, 0)) for per in paired.values()),
                     *([str(size)] if per_bucket else []), str(batches), str(rest)])
    shown = "" if per_bucket else f"micro_batch_size={micro_batch_size}, "
    header = ["resolution", "frames", *(["control images"] if edits else []), "items"]
    header += ["with sound"] if sound else []
    header += [PAIRED_COLUMNS[role] for role in paired]
    header += [*(["micro-batch"] if per_bucket else []), "micro-batches/rank", "remainder"]
    total = ["total", "", *([""] if edits else []), str(sum(groups.values())), *([str(sum(sound.values()))] if sound
                                                                                  else [])]
    total += [str(sum(per.values())) for per in paired.values()]
    total += [*([""] if per_bucket else []), str(total_batches), str(total_rest)]
    right = {i for i, name in enumerate(header) if name not in ("resolution", "control images")}
    lines = [f"Buckets ({shown}data-parallel ranks={dp_world_size}):", *_table(header, [*rows, total], right=right)]
    if total_rest:
        lines.append(
            f"{total_rest} samples per epoch are a remainder that cannot fill a micro-batch on every "
            "data-parallel rank in their bucket."
        )
    if empty:
        lines.append("buckets too small for even one micro-batch: " + ", ".join(empty))
    lines += regularization_lines(scan, dataset)
    with_controls = sum(1 for item in scan.items if item.controls)
    if with_controls:
        lines.append(f"Edit pairs: {_n(with_controls, 'item')} with control images, "
                     f"{_n(len(scan.items) - with_controls, 'item')} without.")
    lines.append("")
    if scan.skipped:
        lines.append(f"Left out ({_n(len(scan.skipped), 'file')}):")
        lines += _table(
            ["file", "reason"],
            [[str(s.path), s.reason] for s in sorted(scan.skipped, key=lambda s: str(s.path))],
            right=set(),
        )
        lines.append("")
    cropped = [item for item in scan.items if item.crop_fraction > CROP_WARN]
    if cropped:
        worst = max(cropped, key=lambda item: item.crop_fraction)
        lines.append(
            f"{_n(len(cropped), 'item')} cropped by more than {CROP_WARN:.0%} of the image to fit its bucket "
            f"(most: {worst.id}, {worst.crop_fraction:.0%}); widen min_ar/max_ar or ar_buckets to keep more of "
            "them, or set drop_outside_ar = true to leave out those outside min_ar..max_ar."
        )
        lines.append("")
    files = len({item.path for item in scan.items})
    by_cat = Counter(reason_category(s.reason) for s in scan.skipped)
    summary = f"Summary: {_n(files, 'file')} used, {_n(len(scan.items), 'item')} in {_n(len(counts), 'bucket')}, "
    summary += f"{_n(len(scan.skipped), 'file')} left out"
    if by_cat:
        summary += " (" + ", ".join(f"{n} {cat}" for cat, n in by_cat.most_common()) + ")"
    lines.append(summary + ".")
    return "\n".join(lines)
