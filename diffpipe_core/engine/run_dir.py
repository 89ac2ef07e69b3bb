"""The run folder: one per training run under ``output_dir``, and resolving ``--resume``."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from diffpipe_core import __version__
from diffpipe_core.atomic import atomic_write_text

CHECKPOINTS = "checkpoints"
LATEST = "latest"


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
    """A new run folder for the validated config ``cfg`` (a ResolvedConfig), with its run info written."""
    from diffpipe_core.registry import get_registry

    run_dir = new_run_dir(cfg.run.output_dir)
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


def resolve_resume(output_dir: Path, resume: str) -> tuple[Path, Path]:
    """``(run_dir, checkpoint_dir)`` for ``--resume latest``, a run folder, or a checkpoint folder."""
    if resume == "latest":
        runs = (
            sorted((p for p in output_dir.iterdir() if p.is_dir()), key=lambda p: p.name) if output_dir.is_dir() else []
        )
        for run in reversed(runs):
            ckpt = latest_checkpoint(run)
            if ckpt is not None:
                return run, ckpt
        raise FileNotFoundError(f"--resume latest: no run under {output_dir} has a checkpoint yet")
    path = Path(resume).resolve()
    if (path / "train_state.json").is_file():
        return path.parent.parent, path
    ckpt = latest_checkpoint(path) if path.is_dir() else None
    if ckpt is None:
        raise FileNotFoundError(
            f"--resume {resume}: not a run folder with checkpoints/{LATEST} "
            "nor a checkpoint folder with train_state.json"
        )
    return path, ckpt


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
