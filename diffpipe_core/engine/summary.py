"""The end-of-run summary: steps, time, how the loss moved over the run, skipped steps."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TrainSummary:
    steps: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    skipped_steps: list[int] = field(default_factory=list)
    seconds: float = 0.0
    samples: int = 0
    first_quarter_loss: float | None = None  # mean training loss of the run's first quarter of steps
    last_quarter_loss: float | None = None


def quarter_means(run_dir: Path) -> tuple[float | None, float | None]:
    """Mean finite training loss of the first and of the last quarter of the run's steps (from metrics.jsonl,
    so a resumed run counts its steps before the resume too). Single steps are too noisy to show learning."""
    from diffpipe_core.engine.run_dir import train_losses

    losses = [v for _, v in sorted(train_losses(run_dir).items()) if v is not None and math.isfinite(v)]
    if not losses:
        return None, None
    q = max(1, len(losses) // 4)
    return sum(losses[:q]) / q, sum(losses[-q:]) / q


def format_summary(summary: TrainSummary) -> str:
    """The end-of-run line: steps, time, how the loss moved, skipped steps."""
    line = f"trained {summary.steps} steps ({summary.samples} samples) in {summary.seconds:.1f} s"
    first, last = summary.first_quarter_loss, summary.last_quarter_loss
    if first is not None and last is not None:
        change = f" ({(last - first) / first:+.0%})" if first > 0 else ""
        line += f"; mean loss {first:.4f} in the first quarter of steps -> {last:.4f} in the last{change}"
    if summary.skipped_steps:
        line += f"; skipped steps (non-finite loss): {summary.skipped_steps}"
    return line
