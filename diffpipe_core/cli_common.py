"""What the ``diffpipe`` commands share: loading and checking a run config, and reporting problems.

Its own module so that commands defined elsewhere (``diffpipe sample``) use it without importing ``cli.py``,
which imports them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from diffpipe_core.registry import PluginError, get_registry
from diffpipe_core.schema import ConfigError

# What a user's input can cause (bad files, configs, folders): reported as a message, not a traceback.
USER_ERRORS = (ConfigError, PluginError, OSError, ValueError, KeyError)


def fail(problems: list[str], note: str | None = None) -> None:
    if len(problems) == 1 and "\n" not in problems[0]:
        click.echo(f"diffpipe: error: {problems[0]}", err=True)
    else:
        click.echo(f"{len(problems)} problem{'s' if len(problems) != 1 else ''}:", err=True)
        for p in problems:
            click.echo(f"  - {p}", err=True)
    if note:
        click.echo(f"({note})", err=True)
    sys.exit(1)


def primary() -> bool:
    """Whether this process prints what every rank would (not a rank > 0 that an external launcher started)."""
    import os

    return os.environ.get("RANK", "0") == "0"


def load_checked(
    config_path: Path,
    model: str | None,
    world_size: int | None = None,
    check_work: bool = False,
    purpose: str = "train",
    training: bool = True,
):
    """The validated config, or exit listing every problem. ``check_work`` also checks what the work needs
    before any is done: the model files' structure (the plugin's ``validate_model_files``) and a scan of every
    dataset (an empty one fails), and for ``training`` (not ``diffpipe cache``) enough micro-batches for
    ``gradient_accumulation_steps`` and enough model layers for ``pipeline_stages``; it says how the model rounds
    the resolutions. ``purpose="sample"`` (``diffpipe sample``) reads no dataset."""
    from diffpipe_core.config import check_world_size, load_config
    from diffpipe_core.data.dataset_config import load_dataset_config

    problems: list[str] = []
    cfg = None
    try:
        cfg = load_config(config_path, get_registry(), model_override=model, purpose=purpose)  # type: ignore[arg-type]
    except ConfigError as exc:
        problems.extend(exc.problems)
    if cfg is not None:
        datasets = []
        try:
            if purpose == "train":
                datasets.append(load_dataset_config(cfg.run.dataset))
                for ev in cfg.run.eval_datasets:
                    datasets.append(load_dataset_config(ev.config))
        except ConfigError as exc:
            problems.extend(exc.problems)
        if world_size is not None:
            try:
                check_world_size(cfg.run, world_size, str(cfg.path))
            except ConfigError as exc:
                problems.extend(exc.problems)
        if check_work and not problems:
            problems.extend(work_problems(cfg, datasets, world_size, training))
    if problems:
        fail(problems)
    return cfg


def work_problems(cfg, datasets: list, world_size: int | None = None, training: bool = True) -> list[str]:
    from diffpipe_core.data.scan import DatasetError, scan_dataset
    from diffpipe_core.model_files import model_file_problems
    from diffpipe_core.preflight import (
        adapter_format_problems,
        frame_notes,
        layer_problems,
        micro_batch_problems,
        optimizer_problems,
        resolution_notes,
        trained_name_problems,
    )

    plugin = get_registry().model(cfg.model_name)
    problems = model_file_problems(plugin, cfg.model)
    dp = world_size // (cfg.run.pipeline_stages * cfg.run.sequence_parallel) if world_size else None
    for i, dataset in enumerate(datasets):
        try:
            scan = scan_dataset(dataset, plugin.spec, report_skipped=primary())
        except (DatasetError, ConfigError) as exc:
            problems.extend(getattr(exc, "problems", None) or [f"{dataset.source}: {exc}"])
            continue
        if i == 0 and training:
            problems.extend(micro_batch_problems(cfg.run, scan, dp, str(cfg.path)))
            problems.extend(training_method_problems(cfg, dataset, dp))
            if primary():
                from diffpipe_core.data.report import regularization_lines

                for line in regularization_lines(scan, dataset):
                    click.echo(f"diffpipe: {line.strip()}")
        if primary():
            for note in resolution_notes(dataset, plugin.spec) + frame_notes(dataset, plugin.spec):
                click.echo(f"diffpipe: {note}")
    if training and not problems:
        problems.extend(layer_problems(cfg, plugin))
        problems.extend(optimizer_problems(cfg))
        problems.extend(adapter_format_problems(cfg, plugin))
        problems.extend(trained_name_problems(cfg, plugin))
    return problems


def training_method_problems(cfg, dataset, dp: int | None) -> list[str]:
    """Combinations of issue 42's methods that cannot run, found before any work: diff_output_preservation with
    ``[model] cfg``, gradient release with several data-parallel replicas per stage."""
    problems = []
    if getattr(dataset, "diff_output_preservation", False) and getattr(cfg.model, "cfg", None) is not None:
        problems.append(f"{dataset.source}: diff_output_preservation cannot be combined with [model] cfg in "
                        f"{cfg.path}: the unconditional pass covers the captions, not the class prompts")
    if cfg.run.optimizer.gradient_release and cfg.run.sequence_parallel > 1:
        problems.append(f"{cfg.path}: optimizer.gradient_release: sequence_parallel = {cfg.run.sequence_parallel}; a "
                        "released parameter is stepped before the sequence ranks' gradients could be summed")
    if cfg.run.optimizer.gradient_release and dp is not None and dp > 1:
        problems.append(f"{cfg.path}: optimizer.gradient_release: {dp} data-parallel replicas per stage; a released "
                        "parameter is stepped before the replicas' gradients could be averaged, so it needs as many "
                        "processes as pipeline_stages")
    return problems
