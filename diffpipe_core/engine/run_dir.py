"""The run folder: one per training run under ``output_dir``, and resolving ``--resume``."""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffpipe_core import __version__
from diffpipe_core.atomic import atomic_write_text

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TRAIN_STATE_FILE = "train_state.json"


def new_run_dir(output_dir: Path) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        candidate = output_dir / (stamp if i == 0 else f"{stamp}-{i}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"{output_dir}: could not create a new run folder")


def write_run_info(
    run_dir: Path, config_text: str, resolved: dict[str, Any], plugins: dict[str, str], extra: dict[str, Any]
) -> None:
    """``config.toml`` as given, ``resolved_config.json`` (every key, defaults filled in, absolute paths) and
    ``run_info.json`` (versions of diffpipe and every plugin, the process layout)."""
    atomic_write_text(run_dir / "config.toml", config_text)
    atomic_write_text(run_dir / "resolved_config.json", json.dumps(resolved, indent=2))
    info = {
        "diffpipe_core": __version__,
        "plugins": plugins,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        **extra,
    }
    atomic_write_text(run_dir / "run_info.json", json.dumps(info, indent=2))


def start_run(cfg: Any, num_procs: int) -> Path:
    """A new run folder for the validated config ``cfg`` (a ResolvedConfig), with its run info written, held by this
    process (:mod:`diffpipe_core.engine.run_lock`)."""
    from diffpipe_core.engine.run_lock import hold_run_folder
    from diffpipe_core.registry import get_registry

    run_dir = new_run_dir(cfg.run.output_dir)
    hold_run_folder(run_dir)
    plugins = {
        p.name: f"{p.distribution or 'in-process'} {p.version or ''}".strip() for p in get_registry().plugins.values()
    }
    write_run_info(
        run_dir,
        cfg.path.read_text(),
        {"run": cfg.run.model_dump(mode="json"), "model": cfg.model.model_dump(mode="json")},
        plugins,
        {"model": cfg.model_name, "num_procs": num_procs, "pipeline_stages": cfg.run.pipeline_stages},
    )
    return run_dir


def latest_checkpoint(run_dir: Path) -> Path | None:
    marker = run_dir / CHECKPOINTS / LATEST
    if not marker.is_file():
        return None
    ckpt = run_dir / CHECKPOINTS / marker.read_text().strip()
    return ckpt if ckpt.is_dir() else None


@dataclass(frozen=True)
class Resume:
    """Where ``--resume`` continues: the run folder, its checkpoint, and what the choice skipped (one line each)."""

    run_dir: Path
    checkpoint: Path
    notes: tuple[str, ...] = ()


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and ((path / "run_info.json").is_file() or (path / CHECKPOINTS).is_dir())


def _newest_whole_checkpoint(run: Path, what: str) -> Resume:
    """The newest checkpoint of ``run`` that is whole, saying why each newer one was passed over; or a
    FileNotFoundError naming what is missing or damaged."""
    from diffpipe_core.engine.checkpoint_check import checkpoint_problems, step_of

    root = run / CHECKPOINTS
    marker = root / LATEST
    candidates = sorted(
        (p for p in root.glob("step-*") if p.is_dir() and step_of(p) is not None), key=step_of, reverse=True
    ) if root.is_dir() else []
    notes: list[str] = []
    if marker.is_file():
        named = marker.read_text().strip()
        if not (root / named).is_dir():
            notes.append(f"{marker} names {named}, which is missing")
    elif candidates:
        notes.append(f"{marker}: missing")
    for ckpt in candidates:
        problems = checkpoint_problems(ckpt)
        if not problems:
            return Resume(run, ckpt, tuple(notes))
        notes.append(f"checkpoint {ckpt.name} is damaged: {'; '.join(problems)}")
    if not candidates:
        raise FileNotFoundError(
            f"{what}: run {run} has no checkpoint" + (f" ({notes[0]})" if notes else "")
            + "; name another run folder to resume it, or train without --resume"
        )
    raise FileNotFoundError(f"{what}: no complete checkpoint in {run}: " + "; ".join(notes))


def resolve_resume(output_dir: Path, resume: str) -> Resume:
    """What ``--resume`` continues: ``latest`` (the newest run under ``output_dir``), a run folder (a bare name is
    looked up in ``output_dir`` first, as in the anchor's ``--resume_from_checkpoint NAME``) or a checkpoint folder.

    A run's newest checkpoint that is damaged or missing gives way to the one before it, and the returned
    ``notes`` say so; a checkpoint folder named outright must itself be whole."""
    from diffpipe_core.engine.checkpoint_check import checkpoint_problems

    what = f"--resume {resume}"
    if resume == "latest":
        runs = sorted((p for p in output_dir.iterdir() if is_run_dir(p)), key=lambda p: p.name) if (
            output_dir.is_dir()
        ) else []
        if not runs:
            raise FileNotFoundError(f"{what}: no run folder under {output_dir}")
        return _newest_whole_checkpoint(runs[-1], what)
    given = Path(resume).expanduser()
    bare = not given.is_absolute() and len(given.parts) == 1
    places = [output_dir / given, given] if bare else [given, output_dir / given]
    path = next((p.resolve() for p in places if p.exists()), None)
    if path is None:
        looked = " nor ".join(str(p.resolve()) for p in dict.fromkeys(places))
        raise FileNotFoundError(f"{what}: not a run folder nor a checkpoint folder: no {looked}")
    if (path / TRAIN_STATE_FILE).is_file() or path.parent.name == CHECKPOINTS:
        problems = checkpoint_problems(path)
        if problems:
            raise FileNotFoundError(f"{what}: checkpoint {path} is damaged: {'; '.join(problems)}")
        return Resume(path.parent.parent, path)
    if not is_run_dir(path):
        raise FileNotFoundError(
            f"{what}: {path} is not a run folder (no run_info.json or {CHECKPOINTS}/) "
            "nor a checkpoint folder with train_state.json"
        )
    return _newest_whole_checkpoint(path, what)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of a run's ``metrics.jsonl``: one per optimizer step (``step``, ``loss``, ``lr``,
    ``grad_norm``, ``samples`` (this step's), ``samples_per_s``, ``step_seconds``, ``epoch``: epochs done, a fraction
    within one) plus one per evaluation (``step``, ``eval``; step 0 with ``eval_before_first_step``)."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_losses(run_dir: Path) -> dict[int, float]:
    """The training loss of each step. A resume drops the records after its checkpoint before logging those
    steps again; should a step still appear twice, its last record wins."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def step_seconds(run_dir: Path) -> list[float]:
    """Seconds per optimizer step (``train_batch`` only: no checkpoint, save or eval time), in step order,
    one per step (the last record of a step)."""
    per_step = {r["step"]: r["step_seconds"] for r in read_metrics(run_dir) if "loss" in r}
    return [per_step[s] for s in sorted(per_step)]


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop the records of steps after ``step`` from ``metrics.jsonl`` (atomically): a resumed run logs
    them again, and each step must appear once."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by the kill
            continue
        if record.get("step", 0) <= step:
            kept.append(line + "\n")
    atomic_write_text(path, "".join(kept))
