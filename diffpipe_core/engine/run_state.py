"""What a run writes while it trains: resumable checkpoints (and reading them back) and saved adapters/models."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from diffpipe_core.adapters import lora_state_dict
from diffpipe_core.config import OptimizerConfig, ResolvedConfig
from diffpipe_core.engine import checkpoint as ckpt_io
from diffpipe_core.engine.finite_weights import check_finite
from diffpipe_core.engine.saving import export_model_formats, gather_to_rank0, write_adapter, write_model_shards
from diffpipe_core.engine.stage_build import DTYPES, Layout, Stage
from diffpipe_core.engine.zero import full_state_dict, load_full_state_dict, model_params
from diffpipe_core.registry import ModelPlugin


def _place(layout: Layout) -> dict[str, int]:
    """This process's place in the run, as the checkpoint and shard writers name their files by it."""
    return {"rank": layout.rank, "stage_id": layout.stage_id, "dp_rank": layout.replica}  # replica 0 writes


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
    """``checkpoints/step-N/``: this stage's trainable tensors, optimizer and schedule state, the data position.
    Refused (:class:`NonFiniteWeights`) when a trainable tensor is not finite."""
    latest = run_dir / "checkpoints" / "latest"
    kept = f"checkpoints/{latest.read_text().strip()} stays" if latest.is_file() else "there is no older checkpoint"
    params = {**stage.trainable, **(stage.ema.checkpoint_tensors() if stage.ema is not None else {})}
    check_finite(params, f"checkpoint at step {step}", kept, _device(stage))
    state = {
        "step": step,
        "micro_index": micro_index,
        "sampler": sampler.state_dict(),
        "world_size": layout.world,
        "pipeline_stages": layout.stages,
        "sequence_parallel": layout.seq,
        "total_steps": total_steps,
    }
    optim_state = {"optimizer": optimizer_state_dict(stage), "scheduler": stage.scheduler.state_dict(),
                   "param_names": optimizer_param_names(stage)}
    ckpt_io.write_checkpoint(
        run_dir,
        step,
        **_place(layout),
        params=params,
        optimizer_state=optim_state,
        train_state=state,
        keep=cfg.run.keep_checkpoints,
        barrier=dist.barrier,
    )


def restore_checkpoint(
    ckpt: Path, layout: Layout, stage: Stage, sampler: Any, optimizer_cfg: OptimizerConfig,
    reset_optimizer: bool = False, reset_dataloader: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint into this stage (under another process layout the optimizer state is re-split by parameter
    name: :func:`resharded_optimizer_state`); the train state.

    The optimizer's hyperparameters (lr, betas, weight decay, eps) are those of ``optimizer_cfg``, the config in
    force now, not the saved ones: a resume after editing them applies the edit (the LR schedule too, being
    rebuilt from the config). ``reset_optimizer`` (``--reset-optimizer``): the weights only, the optimizer state
    starts fresh while the LR schedule goes on from the checkpoint's step. ``reset_dataloader``
    (``--reset-dataloader``): the checkpoint's epoch starts over from its first micro-batch."""
    state = ckpt_io.read_train_state(ckpt)
    params = ckpt_io.read_params(ckpt)
    missing = [n for n in stage.trainable if n not in params]
    if missing:
        raise ValueError(f"checkpoint {ckpt} lacks {len(missing)} trainable tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, p in stage.trainable.items():
            saved = params[name]
            if saved.shape != p.shape:
                raise ckpt_io.CheckpointError(
                    f"checkpoint {ckpt}: {name} has shape {tuple(saved.shape)}, the model's is {tuple(p.shape)}"
                )
            p.copy_(saved.to(p.dtype))
    if stage.zero is not None:  # the weights are views of ZeRO's flat buffer; its float32 partition follows them
        stage.zero.refresh_fp32_params()
    if stage.ema is not None and not stage.ema.load(params) and layout.rank == 0:
        print(f"diffpipe: {ckpt.name} holds no EMA ([ema] is new in this run); the average starts from its weights",
              flush=True)
    if reset_optimizer:
        _continue_schedule(ckpt, layout, stage, optimizer_cfg, state)
        optim = None
    elif state.get("pipeline_stages") == layout.stages and state.get("world_size") == layout.world:
        optim = ckpt_io.read_optimizer_state(ckpt, layout.stage_id)
    else:
        optim = resharded_optimizer_state(ckpt, int(state.get("pipeline_stages") or 1), stage)
        if layout.rank == 0:
            how = "re-split by parameter" if optim is not None else "starts fresh (the checkpoint names no parameters)"
            print(f"diffpipe: process layout changed since {ckpt.name} ({state.get('pipeline_stages')} stages, "
                  f"{state.get('world_size')} processes; now {layout.stages}, {layout.world}); optimizer state "
                  f"{how}", flush=True)
    if optim is not None:
        built = configured_hyperparameters(stage.optimizer)
        load_optimizer_state(stage, optim["optimizer"])
        stage.scheduler.load_state_dict(optim["scheduler"])
        apply_optimizer_config(stage, optimizer_cfg, built)
    sampler.load_state_dict(state["sampler"])
    if reset_dataloader:
        sampler.position = 0
    if layout.rank == 0 and sampler.note:
        print(f"diffpipe: {sampler.note.replace('the checkpoint', ckpt.name, 1)}", flush=True)
    if layout.rank == 0 and (reset_optimizer or reset_dataloader):
        said = ["optimizer state starts fresh (the LR schedule goes on from step "
                f"{state['step']})"] * reset_optimizer + [f"epoch {sampler.epoch} starts over from its first "
                                                          "micro-batch"] * reset_dataloader
        print(f"diffpipe: resuming {ckpt.name} with reset: weights kept; {'; '.join(said)}", flush=True)
    return state


def carried_micro_index(state: dict[str, Any], layout: Layout) -> int:
    """This rank's count of micro-batches drawn, from a checkpoint's train state: under another data-parallel degree,
    the saved ranks' micro-batches shared out over the new ones (the run's global micro-batch sequence goes on)."""
    ways = int(state.get("pipeline_stages") or layout.stages) * int(state.get("sequence_parallel") or 1)
    saved_dp = int(state.get("world_size") or layout.world) // ways
    return int(state["micro_index"]) * saved_dp // layout.dp


def _continue_schedule(
    ckpt: Path, layout: Layout, stage: Stage, optimizer_cfg: OptimizerConfig, state: dict[str, Any]
) -> None:
    """A fresh optimizer's LR schedule at the checkpoint's position (read from a saved stage's schedule state)."""
    saved = ckpt_io.read_optimizer_state(ckpt, min(layout.stage_id, int(state.get("pipeline_stages") or 1) - 1))
    stage.scheduler.last_epoch = int(saved["scheduler"]["last_epoch"])
    apply_optimizer_config(stage, optimizer_cfg)


def optimizer_state_dict(stage: Stage) -> dict[str, Any]:
    """The optimizer's state dict; under ZeRO the replicas' shards gathered into an unsharded optimizer's
    (collective over the replicas: :func:`~diffpipe_core.engine.zero.full_state_dict`)."""
    return full_state_dict(stage.zero) if stage.zero is not None else stage.optimizer.state_dict()


def load_optimizer_state(stage: Stage, saved: dict[str, Any]) -> None:
    """Load an :func:`optimizer_state_dict`; under ZeRO this replica's share of it."""
    if stage.zero is not None:
        load_full_state_dict(stage.zero, saved)
    else:
        stage.optimizer.load_state_dict(saved)


def optimizer_param_names(stage: Stage) -> list[str]:
    """The model names of the optimizer's parameters, in the order its state dict numbers them."""
    names = {id(p): n for n, p in stage.trainable.items()}
    if stage.zero is not None:
        return [names[id(p)] for p in model_params(stage.zero)]
    return [names[id(p)] for group in stage.optimizer.param_groups for p in group["params"]]


def resharded_optimizer_state(ckpt: Path, saved_stages: int, stage: Stage) -> dict[str, Any] | None:
    """This stage's optimizer and LR-schedule state from a checkpoint written under another process layout: each
    parameter's state found by its name among every saved stage's (data-parallel replicas hold the same state), in
    this optimizer's numbering and parameter groups. None when the checkpoint names no parameters (written before
    they were recorded) or lacks one of this stage's."""
    by_name: dict[str, Any] = {}
    scheduler = None
    for s in range(saved_stages):
        saved = ckpt_io.read_optimizer_state(ckpt, s)
        names = saved.get("param_names")
        if names is None:
            return None
        numbers = [i for group in saved["optimizer"]["param_groups"] for i in group["params"]]
        states = saved["optimizer"]["state"]
        by_name.update({name: states[i] for name, i in zip(names, numbers, strict=True) if i in states})
        scheduler = scheduler or saved["scheduler"]
    own = optimizer_state_dict(stage)
    numbers = [i for group in own["param_groups"] for i in group["params"]]
    names = optimizer_param_names(stage)
    if any(name not in by_name for name in names):
        return None
    state = {i: by_name[name] for name, i in zip(names, numbers, strict=True)}
    return {"optimizer": {"state": state, "param_groups": own["param_groups"]}, "scheduler": scheduler}


CONFIGURED = ("betas", "weight_decay", "eps")  # the [optimizer] keys an optimizer's groups hold, besides lr


def configured_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's ``betas``, ``weight_decay`` and ``eps`` as the optimizer was built from the config in force (or
    the optimizer's own defaults where the config gives none, as for a group of Muon's or a third beta)."""
    return [{k: g[k] for k in CONFIGURED if k in g} for g in optimizer.param_groups]


def apply_optimizer_config(
    stage: Stage, cfg: OptimizerConfig, built: list[dict[str, Any]] | None = None
) -> None:
    """Give the loaded optimizer and LR schedule the hyperparameters of ``cfg`` (the loaded state dicts hold the
    old ones), keeping the schedule's position; each parameter group at its ``group_lr`` when it has one. ``built``:
    :func:`configured_hyperparameters` of the optimizer before its state was loaded."""
    from diffpipe_core.optim import DEFAULT_GROUP, forced_lr

    scheduler = stage.scheduler
    groups = stage.optimizer.param_groups
    scheduler.base_lrs = [forced_lr(cfg, cfg.group_lr.get(g.get("name", DEFAULT_GROUP), cfg.lr)) for g in groups]
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, lr, base in zip(groups, lrs, scheduler.base_lrs, strict=True):
        group["lr"], group["initial_lr"] = lr, base
    for group, configured in zip(groups, built or [], strict=False):
        group.update(configured)
    scheduler._last_lr = lrs


def save_trained(
    run_dir: Path, name: str, cfg: ResolvedConfig, plugin: ModelPlugin, layout: Layout, stage: Stage
) -> Path:
    """``saved/<name>/``: the adapter (gathered to rank 0, in every configured format) or the full model's
    shards (one per stage) plus the plugin's model formats; with ``[ema]``, the average the same way in
    ``saved/<name>/ema/``."""
    out = _write_trained(run_dir / "saved" / name, f"saved/{name}", _last_save(run_dir, name), cfg, plugin, layout,
                         stage)
    if stage.ema is not None:
        with stage.ema.swapped_in():
            _write_trained(out / "ema", f"saved/{name}/ema", f"saved/{name} is written", cfg, plugin, layout, stage)
    return out


def _write_trained(
    out: Path, what: str, kept: str, cfg: ResolvedConfig, plugin: ModelPlugin, layout: Layout, stage: Stage
) -> Path:
    """What :func:`save_trained` writes of the stage's trained tensors as they are now, into ``out``."""
    run = cfg.run
    check_finite(stage.trainable, what, kept, _device(stage))
    save_dtype = DTYPES[run.save_dtype]
    if stage.lora is not None:
        merged = gather_to_rank0(lora_state_dict(stage.model), include=layout.replica == 0)
        if layout.rank == 0:
            assert merged is not None
            problems = write_adapter(out, merged, plugin, stage.lora, run.adapter.save_formats, save_dtype, cfg.model)
            _report_save_problems(out, problems)
        dist.barrier()
    else:
        local = {n: p for n, p in stage.model.state_dict().items() if p.device.type != "meta"}
        shards = {"num_stages": layout.stages, "dtype": save_dtype, "barrier": dist.barrier}
        write_model_shards(out, local, **_place(layout), **shards)
        if layout.rank == 0 and run.save_model_formats:
            problems = export_model_formats(out, plugin, cfg.model, run.save_model_formats)
            _report_save_problems(out, problems)
        dist.barrier()
    return out


def _report_save_problems(out: Path, problems: list[str]) -> None:
    for problem in problems:
        print(f"diffpipe: ERROR saving {out}: {problem}", file=sys.stderr, flush=True)


def _device(stage: Stage) -> torch.device:
    return next(iter(stage.trainable.values())).device


def _last_save(run_dir: Path, name: str) -> str:
    folders = sorted((p for p in (run_dir / "saved").glob("*") if p.is_dir() and not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime) if (run_dir / "saved").is_dir() else []
    if (run_dir / "saved" / name).is_dir():
        return f"saved/{name} keeps its previous content"
    return f"saved/{folders[-1].name} is the last finite save" if folders else "nothing was saved before"
