"""A resumed run's config against the one it was trained with: refuse the changes a checkpoint cannot take,
apply and announce the others, and record the config in force from the resumed step.

The run folder's ``config.toml`` and ``resolved_config.json`` always hold the config in force; the ones they
replace are kept as ``config.until-step-N.toml`` and ``resolved_config.until-step-N.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diffpipe_core.atomic import atomic_write_text

RESOLVED = "resolved_config.json"

# key (or a table and everything under it) -> why a checkpoint cannot continue under a changed value
CANNOT_APPLY = {
    "model.type": "the checkpoint holds another model's weights",
    "model.path": "the checkpoint was trained on another base model",
    "adapter": "the checkpoint holds an adapter's tensors, or a full model's",
    "adapter.type": "the checkpoint holds another adapter kind's tensors",
    "adapter.rank": "the checkpoint's LoRA tensors have the old rank",
    "adapter.target_modules": "the checkpoint's LoRA tensors are for the old modules",
    "optimizer.type": "the checkpoint's optimizer state is another optimizer's; --reset-optimizer starts a fresh one",
    "adapter.exclude_modules": "the checkpoint's adapter tensors are for the old modules",
    "model.merge_adapters": "the checkpoint was trained on a base with other adapters merged in",
}
NEW_RUN_HINT = "start a new run (adapter.init_from_existing can start from this run's saved adapter)"
NOTES = {
    "pipeline_stages": "the weights and the optimizer state are re-split by parameter",
    "sequence_parallel": "the sequence ranks hold the same tensors; the data order follows the data-parallel replicas",
    "partition_split": "the weights and the optimizer state are re-split by parameter",
    "adapter.init_from_existing": "ignored: a resumed run starts from its checkpoint",
    "output_dir": "the run stays in its folder",
    "micro_batch_size_per_gpu": "the epoch's data order restarts",
    "dataset": "the epoch's data order restarts if the items changed",
    "seed": "the epoch's data order restarts",
}


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optimizer": {"lr": 1}}`` -> ``{"optimizer.lr": 1}``; a table that is absent (None) stays one key."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key not in ("sample",):
            out[name] = "(a table)"
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def resolved_dump(cfg: Any) -> dict[str, Any]:
    """The resolved form of a config that a run folder records (every key, defaults filled in)."""
    return {"run": cfg.run.model_dump(mode="json"), "model": cfg.model.model_dump(mode="json")}


def _as_keys(resolved: dict[str, Any]) -> dict[str, Any]:
    run = dict(resolved.get("run", {}))
    run["model"] = resolved.get("model", run.get("model"))
    return flatten(run)


def changes(saved: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved value, new value)}`` for each key whose value differs (a table's own marker is left out
    when only its keys changed)."""
    before, after = _as_keys(saved), _as_keys(new)
    out = {}
    for key in sorted(set(before) | set(after)):
        old, now = before.get(key), after.get(key)
        if old != now and not (old == "(a table)" and now == "(a table)"):
            if "." in key and key.rsplit(".", 1)[0] in out:
                continue  # under a table that appeared or went away: that table is the change
            out[key] = (old, now)
    return out


def _show(value: Any) -> str:
    return "(absent)" if value is None else ("(a table)" if value == "(a table)" else repr(value))


def review(
    saved: dict[str, Any], new: dict[str, Any], step: int, fresh_optimizer: bool = False
) -> tuple[list[str], list[str]]:
    """``(refused, applied)``: one line per changed key, naming both values. ``fresh_optimizer``
    (``--reset-optimizer``): the optimizer's state is not read, so its type may change."""
    refused, applied = [], []
    for key, (old, now) in changes(saved, new).items():
        if key == "optimizer.type" and fresh_optimizer:
            applied.append(f"{key}: {_show(old)} -> {_show(now)} from step {step} (a fresh optimizer: "
                           "--reset-optimizer)")
        elif key in CANNOT_APPLY:
            refused.append(
                f"{key}: {_show(old)} when the run was trained, {_show(now)} now: cannot apply to a resumed run "
                f"({CANNOT_APPLY[key]}); change it back, or {NEW_RUN_HINT}"
            )
        elif key != "model":
            note = NOTES.get(key, "applies")
            applied.append(f"{key}: {_show(old)} -> {_show(now)} from step {step} ({note})")
    return refused, applied


def record(run_dir: Path, config_text: str, resolved: dict[str, Any], step: int) -> None:
    """Make ``config_text`` (and its resolved form) the run folder's config from ``step``, keeping the previous."""
    tag = f"until-step-{step:07d}"
    for name, text in (("config.toml", config_text), (RESOLVED, json.dumps(resolved, indent=2))):
        current = run_dir / name
        if current.is_file():
            stem, dot, ext = name.partition(".")
            atomic_write_text(run_dir / f"{stem}.{tag}{dot}{ext}", current.read_text())
        atomic_write_text(current, text)


def saved_config(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / RESOLVED
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
