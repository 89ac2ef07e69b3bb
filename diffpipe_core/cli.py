"""The ``diffpipe`` command line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from diffpipe_core.cli_common import USER_ERRORS, fail, load_checked
from diffpipe_core.engine.fast_exit import exit_now
from diffpipe_core.plugin_cli import plugin as plugin_commands
from diffpipe_core.quiet import VERBOSE_ENV, log_through_bars, quiet_libraries
from diffpipe_core.registry import PluginError, get_registry
from diffpipe_core.sampling.command import sample as sample_command

if "--verbose" in sys.argv[1:]:  # plugins are imported below, before click parses the flag
    os.environ[VERBOSE_ENV] = "1"
quiet_libraries()
log_through_bars()

CONFIG = click.option(
    "--config", "config_path", required=True, type=click.Path(path_type=Path), help="The run config (TOML)."
)
MODEL = click.option("--model", default=None, help="Model plugin name; defaults to [model] type in the config.")


class _Main(click.Group):
    """The command group: an error a user can cause prints one line (a traceback only with ``--debug``)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except USER_ERRORS as exc:
            if os.environ.get("DIFFPIPE_DEBUG"):
                raise
            problems = getattr(exc, "problems", None)
            fail(problems if problems else [str(exc) or type(exc).__name__], "run with --debug for a traceback")


@click.group(cls=_Main)
@click.version_option(package_name="diffpipe-core")
@click.option("--debug", is_flag=True, help="Show tracebacks of errors (in the worker processes too).")
@click.option("--verbose", is_flag=True, help="Show the libraries' own messages (DeepSpeed, transformers, ...).")
def main(debug: bool, verbose: bool) -> None:
    """diffpipe: train image and video diffusion models with pipeline parallelism."""
    if debug:
        os.environ["DIFFPIPE_DEBUG"] = "1"  # inherited by the workers
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    quiet_libraries()
    for line in get_registry().clashes:  # two installed plugins claim one name: say so before any command
        click.echo(f"diffpipe: {line}", err=True)


@main.command()
def models() -> None:
    """List installed model plugins (and any that failed to load)."""
    registry = get_registry()
    rows = registry.models()
    if not rows:
        click.echo("No model plugins installed. Install one, e.g.: pip install diffpipe-flux")
        return
    from diffpipe_core.sampling.config import can_sample

    width = max(14, *(len(info.name) + 1 for info in rows))
    click.echo(f"{'model':<{width}} {'kind':<6} {'distribution':<24} {'version':<10} {'sample':<7} status")
    for info in rows:
        kind = info.spec.modality if info.spec else "?"
        status = "ok" if info.ok else f"FAILED: {info.error}"
        samples = "yes" if can_sample(info, registry) else "no"  # implements the denoising hooks
        click.echo(
            f"{info.name:<{width}} {kind:<6} {info.distribution or '(in-process)':<24} {info.version or '-':<10} "
            f"{samples:<7} {status}"
        )


@main.command()
@CONFIG
@MODEL
@click.option("--num-procs", type=int, default=None, help="Also check pipeline_stages against this many processes.")
@click.option("--plan", "show_plan", is_flag=True, help="Print the stage plan for a single stage too.")
@click.option(
    "--gpu-memory",
    default=None,
    help="With --plan: the memory of each GPU (24GB, 80GiB, 24000MB; GB = GiB): print the cheapest pipeline stages, "
    "activation checkpointing, block swap and quantization whose estimated peak fits each GPU, as a run.toml "
    "fragment, or what does not fit and by how much (exit 1).",
)
@click.option("--gpus", type=str, default=None, help="With --gpu-memory: how many GPUs (default 1).")
def validate(
    config_path: Path,
    model: str | None,
    num_procs: int | None,
    show_plan: bool,
    gpu_memory: str | None,
    gpus: str | None,
) -> None:
    """Check the run config and its dataset config without reading any weights; with several pipeline stages (or
    --plan), print the stage plan (the model built on the meta device); with --gpu-memory, fit it to a GPU."""
    budget, count = _fit_options(gpu_memory, gpus)
    cfg = load_checked(config_path, model, num_procs, check_work=True)
    click.echo(f"{cfg.path}: ok (model {cfg.model_name}, dataset {cfg.run.dataset})")
    describe = getattr(get_registry().model(cfg.model_name).info.module, "model_file_lines", None)
    for line in describe(cfg.model) if describe else ():
        click.echo(line)
    stages, seq = cfg.run.pipeline_stages, cfg.run.sequence_parallel
    if num_procs is None:
        ways = stages * seq
        fits = ", ".join(str(ways * k) for k in range(1, 5))
        named = f"pipeline_stages x sequence_parallel = {stages} x {seq}" if seq > 1 else f"pipeline_stages = {stages}"
        click.echo(
            f"{named}: train with a multiple of {ways} processes ({fits}, ...); "
            "each group of pipeline stages is one data-parallel replica"
        )
    elif seq > 1:
        click.echo(f"layout: {stages} pipeline stage(s) x {seq} sequence ranks x {num_procs // (stages * seq)} "
                   f"data-parallel replica(s) = {num_procs} processes")
    if cfg.run.pipeline_stages > 1 or seq > 1 or show_plan or budget is not None:
        _echo_plan(cfg)
    if budget is not None:
        from diffpipe_core.engine.gpu_fit import fit_config, format_fit

        fit = fit_config(cfg, get_registry().model(cfg.model_name), budget, count)
        click.echo("\n".join(format_fit(fit)))
        if not fit.fits:
            sys.exit(1)


def _fit_options(gpu_memory: str | None, gpus: str | None) -> tuple[int | None, int]:
    """``--gpu-memory`` in bytes and ``--gpus``, checked before any work (a bad value names the option and the valid
    forms)."""
    from diffpipe_core.engine.gpu_fit import parse_memory

    problems = []
    count = 1
    if gpus is not None:
        if gpu_memory is None:
            problems.append("--gpus: only with --gpu-memory (the GPUs to fit the run on)")
        elif not gpus.strip().isdigit() or int(gpus) < 1:
            problems.append(f"--gpus: {gpus!r} is not a number of GPUs; valid: a whole number >= 1, e.g. --gpus 4")
        else:
            count = int(gpus)
    budget = None
    if gpu_memory is not None:
        try:
            budget = parse_memory(gpu_memory)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        fail(problems)
    return budget, count


@main.command("plan-table")
@click.argument("model_type")
def plan_table(model_type: str) -> None:
    """Print MODEL_TYPE's GPU-fit table (Markdown, estimates): the savers `validate --plan --gpu-memory` picks for 24,
    48 and 80 GB at the model's usual resolutions, for the released size its plugin declares (plan_size)."""
    from diffpipe_core.engine.fit_table import fit_table_markdown

    click.echo(fit_table_markdown(model_type), nl=False)


def _echo_plan(cfg) -> None:
    from diffpipe_core.engine.plan_build import plan_report

    click.echo("\n".join(plan_report(cfg, get_registry().model(cfg.model_name))))


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
@click.option(
    "--reset-optimizer",
    is_flag=True,
    help="With --resume: keep the weights, start the optimizer state fresh (the LR schedule goes on from the "
    "checkpoint's step); [optimizer] type may then change.",
)
@click.option(
    "--reset-dataloader", is_flag=True, help="With --resume: start the checkpoint's epoch over from its first batch."
)
@click.option("--regenerate-cache", is_flag=True, help="Re-encode the whole dataset.")
@click.option("--strict", is_flag=True, help="Key the cache on file hashes rather than size and mtime.")
@click.option("--trust-cache", is_flag=True, help="Use the cache index without re-checking the files.")
@click.option(
    "--hostfile",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Several machines: a DeepSpeed hostfile ('host slots=N' lines); DeepSpeed's launcher starts the workers.",
)
def train(
    config_path: Path,
    model: str | None,
    num_procs: int | None,
    resume: str | None,
    reset_optimizer: bool,
    reset_dataloader: bool,
    regenerate_cache: bool,
    strict: bool,
    trust_cache: bool,
    hostfile: Path | None,
) -> None:
    """Cache the dataset if needed, then train and save.

    Started by a launcher (torchrun, DeepSpeed's, a SLURM script setting RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT), each process runs as that worker instead of starting its own.
    """
    from diffpipe_core.engine.launcher import (
        default_num_procs,
        hostfile_slots,
        launch_deepspeed,
        launch_workers,
        launched_externally,
    )
    from diffpipe_core.engine.resume import prepare_resume
    from diffpipe_core.engine.run_dir import start_run

    resets = ["--reset-optimizer"] * reset_optimizer + ["--reset-dataloader"] * reset_dataloader
    if resets and not resume:
        raise click.UsageError(f"{' and '.join(resets)}: only for a resumed run; add --resume (a run or checkpoint "
                               "folder, or 'latest')")
    external = launched_externally()
    if external is not None:
        n = external
    elif hostfile is not None:
        n = hostfile_slots(hostfile)
    else:
        n = default_num_procs(num_procs)
    cfg = load_checked(config_path, model, n, check_work=True)
    args = ["--config", str(cfg.path), "--model", cfg.model_name, "--scanned"]
    if resume:
        primary = external is None or os.environ.get("RANK") == "0"
        chosen = prepare_resume(cfg, resume, n, click.echo, primary, reset_optimizer)  # bad: one message, see _Main
        if chosen is None:
            return  # finished: nothing to do
        args += ["--run-dir", str(chosen.run_dir), "--resume-from", str(chosen.checkpoint), *resets]
    elif external is not None:
        args += ["--new-run"]  # rank 0 creates the run folder and tells the others
    else:
        run_dir = start_run(cfg, n)
        click.echo(f"diffpipe: run folder {run_dir}")
        args += ["--run-dir", str(run_dir)]
    args += ["--regenerate"] * regenerate_cache + ["--strict"] * strict + ["--trust-cache"] * trust_cache
    if external is not None:
        from diffpipe_core.engine.worker import main as worker_main

        exit_now(worker_main(args))
    if hostfile is not None:
        sys.exit(launch_deepspeed(hostfile, args))
    exit_now(launch_workers(args, n))


@main.command()
@CONFIG
@MODEL
@click.option("--num-procs", type=int, default=None, help="Worker processes sharing the encoding.")
@click.option("--regenerate-cache", is_flag=True, help="Re-encode the whole dataset.")
@click.option("--strict", is_flag=True, help="Key the cache on file hashes rather than size and mtime.")
@click.option(
    "--prune", is_flag=True, help="Then delete (and list) cached encodings of other encoder settings or model files."
)
def cache(config_path: Path, model: str | None, num_procs: int | None, regenerate_cache: bool, strict: bool,
          prune: bool) -> None:
    """Encode the dataset into the latent/text cache (what train does first)."""
    from diffpipe_core.engine.launcher import default_num_procs, launch_workers

    n = default_num_procs(num_procs)
    cfg = load_checked(config_path, model, check_work=True, training=False)
    args = ["--config", str(cfg.path), "--model", cfg.model_name, "--cache-only", "--scanned"]
    args += ["--regenerate"] * regenerate_cache + ["--strict"] * strict + ["--prune"] * prune
    exit_now(launch_workers(args, n))


@main.command()
@CONFIG
@MODEL
@click.option("--num-procs", type=int, default=None, help="Data-parallel processes the table assumes.")
@click.option(
    "--dump",
    "dump_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Also write each item as it will be trained (crop, resize; a clip's first and last frame; its mask and "
    "control images beside it) and a contact sheet per bucket into this new folder.",
)
def data(config_path: Path, model: str | None, num_procs: int | None, dump_dir: Path | None) -> None:
    """Show buckets, micro-batches per epoch, every file left out with why, and the stage plan."""
    from diffpipe_core.data.dataset_config import load_dataset_config
    from diffpipe_core.data.dump import check_dump_dir
    from diffpipe_core.data.report import format_report
    from diffpipe_core.data.scan import DatasetError, scan_dataset
    from diffpipe_core.engine.launcher import default_num_procs

    if dump_dir is not None and (problem := check_dump_dir(dump_dir)):
        fail([problem])
    n = default_num_procs(num_procs)
    cfg = load_checked(config_path, model, n)
    spec = get_registry().model(cfg.model_name).spec
    run = cfg.run
    sizes = run.micro_batch_size_per_gpu
    if not isinstance(sizes, int) or run.image_micro_batch_size_per_gpu is not None:
        sizes = lambda bucket: run.micro_batch_size_for(bucket.width, bucket.height, bucket.frames)  # noqa: E731
    try:
        dataset_cfg = load_dataset_config(cfg.run.dataset)
        scan = scan_dataset(dataset_cfg, spec)
    except DatasetError as exc:  # empty: the report still lists every file left out, and why
        if exc.result is not None and exc.result.skipped:
            click.echo(format_report(exc.result, sizes, n // cfg.run.pipeline_stages))
        fail([f"{cfg.run.dataset}: {exc.summary}"])
    except Exception as exc:
        fail([f"{cfg.run.dataset}: {exc}"])
    click.echo(format_report(scan, sizes, n // cfg.run.pipeline_stages, dataset_cfg))
    _echo_plan(cfg)
    if dump_dir is not None:
        _dump(scan, spec, dump_dir)


def _dump(scan, spec, out: Path) -> None:
    from diffpipe_core.data.dump import dump_dataset

    summary = dump_dataset(scan, spec, out)
    click.echo(f"diffpipe: wrote {summary.items} item images to {out / 'items'} and {len(summary.sheets)} bucket "
               f"contact sheets to {out / 'sheets'}")
    for item_id, why in summary.failed:
        click.echo(f"diffpipe: not dumped: {item_id}: {why}")


@main.command("import-config")
@click.argument("anchor_config", type=click.Path(path_type=Path))
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder for run.toml and dataset.toml (default: diffpipe/ beside the config).",
)
@click.option(
    "--anchor-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="The folder diffusion-pipe ran in, where its relative paths start (default: the current directory).",
)
@click.option(
    "--dataset",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="The dataset config to convert, instead of the one the config names.",
)
@click.option("--force", is_flag=True, help="Replace files already in the output folder.")
def import_config(anchor_config: Path, out_dir: Path | None, anchor_dir: Path | None, dataset: Path | None,
                  force: bool) -> None:
    """Write a diffpipe run.toml and dataset.toml from a tdrussell/diffusion-pipe config.

    A comment above each key says what changed (name, value, table or file) and why; each key that could not be
    carried is listed where it was. Values diffpipe needs that the config does not give are TODOs.
    """
    from diffpipe_core.anchor.convert import import_config as convert
    from diffpipe_core.anchor.convert import write_imported

    imported = convert(anchor_config, anchor_dir, dataset)
    out_dir = out_dir or Path(anchor_config).resolve().parent / "diffpipe"
    written = write_imported(imported, out_dir, force)
    c = imported.counts
    click.echo(f"diffpipe: wrote {', '.join(str(p) for p in written)}")
    click.echo(
        f"{c['as is']} key{'s' * (c['as is'] != 1)} as {'they were' if c['as is'] != 1 else 'it was'}, "
        f"{c['changed']} changed, {c['moved']} moved, {c['not carried']} not carried (each has a comment saying why)"
    )
    run_toml = written[0]
    if imported.todo:
        click.echo(f"{len(imported.todo)} to fill in before training (TODO in the files):")
        for item in imported.todo:
            click.echo(f"  - {item}")
        click.echo(f"then check: diffpipe validate --config {run_toml}")
    else:
        click.echo(f"check: diffpipe validate --config {run_toml}")


@main.command("config-reference")
@click.option("--model", default=None, help="Also document this model plugin's [model] keys.")
def config_reference(model: str | None) -> None:
    """Print the config reference (markdown) generated from the schemas."""
    from diffpipe_core.docs import config_reference_markdown

    click.echo(config_reference_markdown(get_registry(), model), nl=False)


main.add_command(plugin_commands)
main.add_command(sample_command)


def _register_plugin_commands() -> None:
    try:
        get_registry().pm.hook.register_commands(cli=main)
    except PluginError as exc:  # pragma: no cover - plugin bug
        click.echo(f"diffpipe: a plugin failed to register commands: {exc}", err=True)


_register_plugin_commands()

if __name__ == "__main__":
    main()
