"""What a run writes while it trains: resumable checkpoints (and reading them back) and saved adapters/models."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from diffpipe_core.adapters import lora_state_dict
from diffpipe_core.config import ResolvedConfig
from diffpipe_core.engine import checkpoint as ckpt_io
from diffpipe_core.engine.saving import export_model_formats, gather_to_rank0, write_adapter, write_model_shards
from diffpipe_core.engine.stage_build import DTYPES, Layout, Stage
from diffpipe_core.registry import ModelPlugin


def write_checkpoint(
    run_dir: Path,
    cfg: ResolvedConfig,
    layout: Layout,
    stage: Stage,
    sampler: Any,
    step: int,
    micro_index: int,
    total_steps: int,
) -> None:
    """``checkpoints/step-N/``: this stage's trainable tensors, optimizer and schedule state, the data position."""
    state = {
        "step": step,
        "micro_index": micro_index,
        "sampler": sampler.state_dict(),
        "world_size": layout.world,
        "pipeline_stages": layout.stages,
        "total_steps": total_steps,
    }
    optim_state = {"optimizer": stage.optimizer.state_dict(), "scheduler": stage.scheduler.state_dict()}
    ckpt_io.write_checkpoint(
        run_dir,
        step,
        rank=layout.rank,
        stage_id=layout.stage_id,
        dp_rank=layout.dp_rank,
        params=stage.trainable,
        optimizer_state=optim_state,
        train_state=state,
        keep=cfg.run.keep_checkpoints,
        barrier=dist.barrier,
    )


def restore_checkpoint(ckpt: Path, layout: Layout, stage: Stage, sampler: Any) -> dict[str, Any]:
    """Load a checkpoint into this stage (optimizer state only under the same process layout); the train state."""
    state = ckpt_io.read_train_state(ckpt)
    params = ckpt_io.read_params(ckpt)
    missing = [n for n in stage.trainable if n not in params]
    if missing:
        raise ValueError(f"checkpoint {ckpt} lacks {len(missing)} trainable tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, p in stage.trainable.items():
            p.copy_(params[name].to(p.dtype))
    if state.get("pipeline_stages") == layout.stages and state.get("world_size") == layout.world:
        optim = ckpt_io.read_optimizer_state(ckpt, layout.stage_id)
        stage.optimizer.load_state_dict(optim["optimizer"])
        stage.scheduler.load_state_dict(optim["scheduler"])
    elif layout.rank == 0:
        print(f"diffpipe: process layout changed since {ckpt.name}; optimizer state starts fresh", flush=True)
    sampler.load_state_dict(state["sampler"])
    return state


def save_trained(
    run_dir: Path, name: str, cfg: ResolvedConfig, plugin: ModelPlugin, layout: Layout, stage: Stage
) -> Path:
    """``saved/<name>/``: the adapter (gathered to rank 0, in every configured format) or the full model's
    shards (one per stage) plus the plugin's model formats."""
    run = cfg.run
    out = run_dir / "saved" / name
    save_dtype = DTYPES[run.save_dtype]
    if stage.lora is not None:
        merged = gather_to_rank0(lora_state_dict(stage.model), include=layout.dp_rank == 0)
        if layout.rank == 0:
            assert merged is not None
            problems = write_adapter(out, merged, plugin, stage.lora, run.adapter.save_formats, save_dtype)
            _report_save_problems(out, problems)
        dist.barrier()
    else:
        local = {n: p for n, p in stage.model.state_dict().items() if p.device.type != "meta"}
        write_model_shards(
            out,
            local,
            rank=layout.rank,
            stage_id=layout.stage_id,
            dp_rank=layout.dp_rank,
            num_stages=layout.stages,
            dtype=save_dtype,
            barrier=dist.barrier,
        )
        if layout.rank == 0 and run.save_model_formats:
            problems = export_model_formats(out, plugin, cfg.model, run.save_model_formats)
            _report_save_problems(out, problems)
        dist.barrier()
    return out


def _report_save_problems(out: Path, problems: list[str]) -> None:
    for problem in problems:
        print(f"diffpipe: ERROR saving {out}: {problem}", file=sys.stderr, flush=True)
