"""``diffpipe plugin``: commands for plugin authors (render the template, refresh the guide)."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.group()
def plugin() -> None:
    """Tools for writing a model plugin."""


@plugin.command("new")
@click.argument("name")
@click.option(
    "--dir",
    "dest_dir",
    type=click.Path(path_type=Path),
    default=Path("."),
    show_default=True,
    help="Folder to create the package in (as diffpipe-NAME/).",
)
@click.option("--video", is_flag=True, help="A video model (5-D video latents; images are 1-frame videos).")
def new(name: str, dest_dir: Path, video: bool) -> None:
    """Create an installable model plugin package NAME from the template: pyproject with the entry point,
    every required hook for a tiny working model, tests wired to the conformance kit."""
    from diffpipe_core.scaffold import render_plugin

    try:
        target = render_plugin(name, dest_dir, video=video)
    except (ValueError, FileExistsError) as exc:
        click.echo(f"diffpipe plugin new: {exc}", err=True)
        sys.exit(1)
    click.echo(f"diffpipe: wrote {target}")
    click.echo(f"  pip install -e {target}\n  pytest {target / 'tests'}\n  diffpipe models")


@plugin.command("guide")
@click.argument("path", required=False, type=click.Path(path_type=Path, dir_okay=False, exists=True))
@click.option("--check", is_flag=True, help="Only report whether PATH is stale (exit 1 when it is).")
def guide(path: Path | None, check: bool) -> None:
    """Print the generated hook and type reference, or refresh the generated blocks of PATH in place
    (e.g. plugins/README.md)."""
    from diffpipe_core.plugin_guide import reference_markdown, refresh_guide

    if path is None:
        click.echo(reference_markdown(), nl=False)
        return
    from diffpipe_core.atomic import atomic_write_text

    text = path.read_text(encoding="utf-8")
    try:
        fresh = refresh_guide(text)
    except ValueError as exc:
        click.echo(f"{path}: {exc}", err=True)
        sys.exit(1)
    if fresh == text:
        click.echo(f"{path}: up to date")
    elif check:
        click.echo(f"{path}: stale; run: diffpipe plugin guide {path}", err=True)
        sys.exit(1)
    else:
        atomic_write_text(path, fresh)
        click.echo(f"{path}: refreshed")
