"""Resumable checkpoints, written atomically and checksummed.

Layout of ``checkpoints/step-N/``: ``params-stage{s}.safetensors`` (the trainable tensors of stage s,
named as in the diffusion model, so a different stage split can still load them),
``optimizer-stage{s}.pt`` (optimizer and LR-schedule state; tensors and plain values only, loaded
with ``weights_only=True``), ``train_state.json`` (step, sampler position, process layout) and
``checksums.json`` (the SHA-256 and size of each of those files, checked before a resume:
:mod:`diffpipe_core.engine.checkpoint_check`).
Everything is written into ``.tmp-step-N`` and renamed when complete; ``checkpoints/latest`` names the
newest complete one. Frozen base weights are never written.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from diffpipe_core.atomic import (
    atomic_save_safetensors,
    atomic_write_bytes,
    atomic_write_text,
    file_digest,
    replace_dir,
    space_checked,
)
from diffpipe_core.engine.run_dir import CHECKPOINTS, LATEST

TRAIN_STATE = "train_state.json"
CHECKSUMS = "checksums.json"
FORMAT = 2
"""``train_state.json``'s ``format``: 2 and later have ``checksums.json``."""


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read; the message names it."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"


def write_checkpoint(
    run_dir: Path,
    step: int,
    *,
    rank: int,
    stage_id: int,
    dp_rank: int,
    params: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    train_state: dict[str, Any],
    keep: int,
    barrier: Callable[[], None],
) -> Path:
    """Collective: every rank calls it; data-parallel rank 0 of each stage writes its stage.

    On a full disk the writing rank removes the partial folder and raises :class:`~diffpipe_core.atomic.NoSpaceError`
    (the other ranks are stopped by the launcher); the previous checkpoint stays."""
    root = run_dir / CHECKPOINTS
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{final.name}"
    previous = root / LATEST
    kept = f"checkpoints/{previous.read_text().strip()} is intact" if previous.is_file() else "no older checkpoint"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob(".tmp-*"):  # from a run killed while saving
            shutil.rmtree(leftover, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    if dp_rank == 0:
        tensors = {k: v.detach().cpu().contiguous() for k, v in params.items()}
        buf = io.BytesIO()
        torch.save(optimizer_state, buf)
        needed = sum(t.numel() * t.element_size() for t in tensors.values()) + buf.tell()
        files = [f"params-stage{stage_id}.safetensors", f"optimizer-stage{stage_id}.pt"]
        with space_checked(tmp, needed, f"stage {stage_id}'s part of checkpoint {final.name}", kept):
            atomic_save_safetensors(tensors, tmp / files[0])
            atomic_write_bytes(tmp / files[1], buf.getbuffer())  # a view: getvalue() would copy the state
            sums = {name: file_digest(tmp / name) for name in files}
            atomic_write_text(tmp / f".sums-stage{stage_id}.json", json.dumps(sums))
    barrier()
    if rank == 0:
        text = json.dumps({**train_state, "format": FORMAT}, indent=2)
        with space_checked(tmp, len(text), f"checkpoint {final.name}", kept):
            atomic_write_text(tmp / TRAIN_STATE, text)
            sums = {TRAIN_STATE: file_digest(tmp / TRAIN_STATE)}
            for part in sorted(tmp.glob(".sums-stage*.json")):
                sums.update(json.loads(part.read_text()))
                part.unlink()
            atomic_write_text(tmp / CHECKSUMS, json.dumps(dict(sorted(sums.items())), indent=2))
        replace_dir(tmp, final)
        atomic_write_text(root / LATEST, final.name)
        complete = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def read_train_state(ckpt: Path) -> dict[str, Any]:
    path = ckpt / TRAIN_STATE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc}") from None


def read_params(ckpt: Path) -> dict[str, torch.Tensor]:
    """Trainable tensors of every stage, by model name."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(ckpt.glob("params-stage*.safetensors")):
        try:
            out.update(load_file(str(file)))
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise CheckpointError(f"{file}: cannot be read: {type(exc).__name__}: {exc}") from None
    return out


def read_optimizer_state(ckpt: Path, stage_id: int) -> dict[str, Any]:
    path = ckpt / f"optimizer-stage{stage_id}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; was the checkpoint written with another pipeline_stages?")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated file: OSError, RuntimeError or an unpickling error
        raise CheckpointError(f"{path}: cannot be read: {type(exc).__name__}: {exc}") from None
