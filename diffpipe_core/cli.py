"""The ``diffpipe`` command line."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from diffpipe_core.registry import PluginError, get_registry
from diffpipe_core.schema import ConfigError

CONFIG = click.option(
    "--config", "config_path", required=True, type=click.Path(path_type=Path), help="The run config (TOML)."
)
MODEL = click.option("--model", default=None, help="Model plugin name; defaults to [model] type in the config.")


def _fail(problems: list[str]) -> None:
    click.echo(f"{len(problems)} problem{'s' if len(problems) != 1 else ''}:", err=True)
    for p in problems:
        click.echo(f"  - {p}", err=True)
    sys.exit(1)


def _load(config_path: Path, model: str | None, world_size: int | None = None):
    from diffpipe_core.config import check_world_size, load_config
    from diffpipe_core.data.dataset_config import load_dataset_config

    problems: list[str] = []
    cfg = None
    try:
        cfg = load_config(config_path, get_registry(), model_override=model)
    except ConfigError as exc:
        problems.extend(exc.problems)
    if cfg is not None:
        try:
            load_dataset_config(cfg.run.dataset)
            for ev in cfg.run.eval_datasets:
                load_dataset_config(ev.config)
        except ConfigError as exc:
            problems.extend(exc.problems)
        if world_size is not None:
            try:
                check_world_size(cfg.run, world_size, str(cfg.path))
            except ConfigError as exc:
                problems.extend(exc.problems)
    if problems:
        _fail(problems)
    return cfg


@click.group()
@click.version_option(package_name="diffpipe-core")
def main() -> None:
    """diffpipe: train image and video diffusion models with pipeline parallelism."""


@main.command()
def models() -> None:
    """List installed model plugins (and any that failed to load)."""
    registry = get_registry()
    rows = registry.models()
    if not rows:
        click.echo("No model plugins installed. Install one, e.g.: pip install diffpipe-flux")
        return
    click.echo(f"{'model':<14} {'kind':<6} {'distribution':<24} {'version':<10} status")
    for info in rows:
        kind = info.spec.modality if info.spec else "?"
        status = "ok" if info.ok else f"FAILED: {info.error}"
        click.echo(
            f"{info.name:<14} {kind:<6} {info.distribution or '(in-process)':<24} {info.version or '-':<10} {status}"
        )


@main.command()
@CONFIG
@MODEL
@click.option("--num-procs", type=int, default=None, help="Also check pipeline_stages against this many processes.")
def validate(config_path: Path, model: str | None, num_procs: int | None) -> None:
    """Check the run config and its dataset config without loading any model."""
    from diffpipe_core.engine.launcher import default_num_procs

    cfg = _load(config_path, model, default_num_procs(num_procs))
    click.echo(f"{cfg.path}: ok (model {cfg.model_name}, dataset {cfg.run.dataset})")


@main.command()
@CONFIG
@MODEL
@click.option("--num-procs", type=int, default=None, help="Worker processes (default: one per GPU, else 1).")
@click.option(
    "--resume",
    default=None,
    is_flag=False,
    flag_value="latest",
    help="Resume: 'latest' (the default when given without a value), a run folder or a checkpoint folder.",
)
@click.option("--regenerate-cache", is_flag=True, help="Re-encode the whole dataset.")
@click.option("--strict", is_flag=True, help="Key the cache on file hashes rather than size and mtime.")
@click.option("--trust-cache", is_flag=True, help="Use the cache index without re-checking the files.")
def train(
    config_path: Path,
    model: str | None,
    num_procs: int | None,
    resume: str | None,
    regenerate_cache: bool,
    strict: bool,
    trust_cache: bool,
) -> None:
    """Cache the dataset if needed, then train and save."""
    from diffpipe_core.engine.launcher import default_num_procs, launch_workers
    from diffpipe_core.engine.run_dir import new_run_dir, resolve_resume, write_run_info

    n = default_num_procs(num_procs)
    cfg = _load(config_path, model, n)
    resume_from = None
    if resume:
        try:
            run_dir, resume_from = resolve_resume(cfg.run.output_dir, resume)
        except FileNotFoundError as exc:
            _fail([str(exc)])
        click.echo(f"diffpipe: resuming {run_dir} from {resume_from.name}")
    else:
        run_dir = new_run_dir(cfg.run.output_dir)
        registry = get_registry()
        plugins = {
            p.name: f"{p.distribution or 'in-process'} {p.version or ''}".strip() for p in registry.plugins.values()
        }
        write_run_info(
            run_dir,
            cfg.path.read_text(),
            {"run": cfg.run.model_dump(mode="json"), "model": cfg.model.model_dump(mode="json")},
            plugins,
            {"model": cfg.model_name, "num_procs": n, "pipeline_stages": cfg.run.pipeline_stages},
        )
        click.echo(f"diffpipe: run folder {run_dir}")
    args = ["--config", str(cfg.path), "--run-dir", str(run_dir), "--model", cfg.model_name]
    if resume_from is not None:
        args += ["--resume-from", str(resume_from)]
    args += ["--regenerate"] * regenerate_cache + ["--strict"] * strict + ["--trust-cache"] * trust_cache
    sys.exit(launch_workers(args, n))


@main.command()
@CONFIG
@MODEL
@click.option("--num-procs", type=int, default=None, help="Worker processes sharing the encoding.")
@click.option("--regenerate", is_flag=True, help="Re-encode everything.")
@click.option("--strict", is_flag=True, help="Key the cache on file hashes rather than size and mtime.")
def cache(config_path: Path, model: str | None, num_procs: int | None, regenerate: bool, strict: bool) -> None:
    """Encode the dataset into the latent/text cache (what train does first)."""
    from diffpipe_core.engine.launcher import default_num_procs, launch_workers

    n = default_num_procs(num_procs)
    cfg = _load(config_path, model)
    args = ["--config", str(cfg.path), "--model", cfg.model_name, "--cache-only"]
    args += ["--regenerate"] * regenerate + ["--strict"] * strict
    sys.exit(launch_workers(args, n))


@main.command()
@CONFIG
@MODEL
@click.option("--num-procs", type=int, default=None, help="Data-parallel processes the table assumes.")
def data(config_path: Path, model: str | None, num_procs: int | None) -> None:
    """Show buckets, micro-batches per epoch, and every file left out with why."""
    from diffpipe_core.data.dataset_config import load_dataset_config
    from diffpipe_core.data.report import format_report
    from diffpipe_core.data.scan import scan_dataset
    from diffpipe_core.engine.launcher import default_num_procs

    n = default_num_procs(num_procs)
    cfg = _load(config_path, model, n)
    spec = get_registry().model(cfg.model_name).spec
    try:
        scan = scan_dataset(load_dataset_config(cfg.run.dataset), spec)
    except Exception as exc:
        _fail([f"{cfg.run.dataset}: {exc}"])
    click.echo(format_report(scan, cfg.run.micro_batch_size_per_gpu, n // cfg.run.pipeline_stages))


@main.command("config-reference")
@click.option("--model", default=None, help="Also document this model plugin's [model] keys.")
def config_reference(model: str | None) -> None:
    """Print the config reference (markdown) generated from the schemas."""
    from diffpipe_core.docs import config_reference_markdown

    click.echo(config_reference_markdown(get_registry(), model), nl=False)


def _register_plugin_commands() -> None:
    try:
        get_registry().pm.hook.register_commands(cli=main)
    except PluginError as exc:  # pragma: no cover - plugin bug
        click.echo(f"diffpipe: a plugin failed to register commands: {exc}", err=True)


_register_plugin_commands()

if __name__ == "__main__":
    main()
