"""Resumable checkpoints, written atomically.

Layout of ``checkpoints/step-N/``: ``params-stage{s}.safetensors`` (the trainable tensors of stage s,
named as in the diffusion model, so a different stage split can still load them),
``optimizer-stage{s}.pt`` (optimizer and LR-schedule state; tensors and plain values only, loaded
with ``weights_only=True``) and ``train_state.json`` (step, sampler position, config digest).
Everything is written into ``.tmp-step-N`` and renamed when complete; ``checkpoints/latest`` names the
newest complete one. Frozen base weights are never written.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from diffpipe_core.atomic import atomic_save_safetensors, atomic_write_bytes, atomic_write_text, replace_dir
from diffpipe_core.engine.run_dir import CHECKPOINTS, LATEST

TRAIN_STATE = "train_state.json"


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
    """Collective: every rank calls it; data-parallel rank 0 of each stage writes its stage."""
    root = run_dir / CHECKPOINTS
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob(".tmp-*"):  # from a run killed while saving
            shutil.rmtree(leftover, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    if dp_rank == 0:
        atomic_save_safetensors(
            {k: v.detach().cpu().contiguous() for k, v in params.items()}, tmp / f"params-stage{stage_id}.safetensors"
        )
        import io

        buf = io.BytesIO()
        torch.save(optimizer_state, buf)
        atomic_write_bytes(tmp / f"optimizer-stage{stage_id}.pt", buf.getvalue())
    barrier()
    if rank == 0:
        atomic_write_text(tmp / TRAIN_STATE, json.dumps(train_state, indent=2))
        replace_dir(tmp, final)
        atomic_write_text(root / LATEST, final.name)
        complete = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def read_train_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / TRAIN_STATE).read_text())


def read_params(ckpt: Path) -> dict[str, torch.Tensor]:
    """Trainable tensors of every stage, by model name."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(ckpt.glob("params-stage*.safetensors")):
        out.update(load_file(str(file)))
    return out


def read_optimizer_state(ckpt: Path, stage_id: int) -> dict[str, Any]:
    path = ckpt / f"optimizer-stage{stage_id}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; was the checkpoint written with another pipeline_stages?")
    return torch.load(path, map_location="cpu", weights_only=True)
