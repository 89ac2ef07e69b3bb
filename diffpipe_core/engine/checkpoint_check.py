"""Is a checkpoint whole? Every file its ``checksums.json`` lists is there, of that size and SHA-256, every
stage's files are listed, and every tensor in them is finite (a checksum proves the bytes are those written, not
that what was written is usable). Used before a resume, which falls back to the previous complete checkpoint when the
newest is damaged (:func:`diffpipe_core.engine.run_dir.resolve_resume`)."""

from __future__ import annotations

import json
from pathlib import Path

from diffpipe_core.atomic import file_digest
from diffpipe_core.engine.checkpoint import CHECKSUMS, FORMAT, TRAIN_STATE


def checkpoint_problems(ckpt: Path) -> list[str]:
    """What is wrong with checkpoint folder ``ckpt``, one line per file (empty: it is whole)."""
    state_file = ckpt / TRAIN_STATE
    try:
        state = json.loads(state_file.read_text())
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError("no 'step' in it")
    except FileNotFoundError:
        return [f"{state_file}: missing"]
    except (OSError, ValueError) as exc:
        return [f"{state_file}: unreadable ({exc})"]
    stages = int(state.get("pipeline_stages") or 1)
    expected = {TRAIN_STATE}
    for s in range(stages):
        expected |= {f"params-stage{s}.safetensors", f"optimizer-stage{s}.pt"}
    sums_file = ckpt / CHECKSUMS
    if int(state.get("format") or 1) < FORMAT:  # written before checksums: check what is there
        return [f"{ckpt / name}: missing" for name in sorted(expected) if not (ckpt / name).is_file()]
    try:
        sums = json.loads(sums_file.read_text())
    except FileNotFoundError:
        return [f"{sums_file}: missing"]
    except (OSError, ValueError) as exc:
        return [f"{sums_file}: unreadable ({exc})"]
    problems = [f"{ckpt / name}: not in {CHECKSUMS}" for name in sorted(expected - set(sums))]
    for name, want in sorted(sums.items()):
        file = ckpt / name
        if not file.is_file():
            problems.append(f"{file}: missing")
            continue
        size = file.stat().st_size
        if size != want.get("bytes"):
            problems.append(f"{file}: {size} bytes, {want.get('bytes')} were written (truncated or changed)")
        elif file_digest(file)["sha256"] != want.get("sha256"):
            problems.append(f"{file}: its content does not match its checksum (corrupted)")
    return problems or nonfinite_problems(ckpt)


def nonfinite_problems(ckpt: Path) -> list[str]:
    """One line per file of ``ckpt`` holding NaN or infinite values, naming the first such tensors."""
    import torch
    from safetensors import safe_open

    problems = []
    for file in sorted(ckpt.glob("params-stage*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            bad = [k for k in f.keys() if _nonfinite(f.get_tensor(k))]
        problems += _said(file, bad)
    for file in sorted(ckpt.glob("optimizer-stage*.pt")):
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        problems += _said(file, [name for name, t in _tensors(state) if _nonfinite(t)])
    return problems


def _nonfinite(tensor: object) -> bool:
    import torch

    return isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())


def _tensors(value: object, prefix: str = "") -> list[tuple[str, object]]:
    """Every tensor in a nested state dict, by its dotted path (``optimizer.state.0.exp_avg``)."""
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in _tensors(v, f"{prefix}{k}.")]
    if isinstance(value, (list, tuple)):
        return [t for i, v in enumerate(value) for t in _tensors(v, f"{prefix}{i}.")]
    return [(prefix.rstrip("."), value)]


def _said(file: Path, bad: list[str]) -> list[str]:
    if not bad:
        return []
    shown = ", ".join(repr(b) for b in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    return [f"{file}: NaN or infinite values in {shown}"]


def step_of(ckpt: Path) -> int | None:
    """N of a ``step-N`` folder name."""
    try:
        return int(ckpt.name.removeprefix("step-"))
    except ValueError:
        return None
