"""Write any installed model type's tiny random-weight model, in its real on-disk layout, from the command line.

    python -m diffpipe_core.testing.tiny_models MODEL_TYPE DIR   # e.g. flux flux-tiny
    python -m diffpipe_core.testing.tiny_models --list           # the model types and their writers

For examples, tries of a config and bug reports without downloading weights. A model plugin declares its writer as
``tiny_writer = "module:function"`` (a ``DiffusersModel`` class attribute, or a module attribute of a module-style
plugin); the function takes the folder and returns it. The folder is what ``[model] path`` takes.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def writer_spec(model_type: str, registry: Any = None) -> str | None:
    """The ``"module:function"`` the model plugin of ``model_type`` declares as its tiny writer, or None.

    Raises the registry's error (naming the installed types) for a type that is not installed."""
    from diffpipe_core.registry import get_registry

    plugin = (registry or get_registry()).model(model_type)
    return getattr(plugin.info.module, "tiny_writer", None)


def load_writer(spec: str) -> Callable[[Path], Any]:
    """The function ``spec`` (``"module:function"``) names."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"tiny_writer {spec!r} is not 'module:function'")
    return getattr(importlib.import_module(module), name)


def write_tiny_model(model_type: str, folder: Path, registry: Any = None) -> Path:
    """Write ``model_type``'s tiny model to ``folder`` and return the folder."""
    spec = writer_spec(model_type, registry)
    if spec is None:
        raise ValueError(f"model type {model_type!r} declares no tiny_writer: its plugin has no tiny model to write")
    load_writer(spec)(Path(folder))
    return Path(folder)


def main(argv: list[str] | None = None) -> int:
    """``python -m diffpipe_core.testing.tiny_models MODEL_TYPE DIR``."""
    from diffpipe_core.registry import PluginError, get_registry

    parser = argparse.ArgumentParser(
        prog="python -m diffpipe_core.testing.tiny_models",
        description="Write a model type's tiny random-weight model (its real on-disk layout) into DIR.",
    )
    parser.add_argument("model_type", nargs="?", help="a model type of `diffpipe models`")
    parser.add_argument("folder", nargs="?", type=Path, help="the folder to write (what [model] path takes)")
    parser.add_argument("--list", action="store_true", help="list the installed model types and their writers")
    args = parser.parse_args(argv)
    registry = get_registry()
    if args.list:
        for info in registry.models():
            spec = getattr(info.module, "tiny_writer", None) if info.ok else None
            print(f"{info.name:<24} {spec or '(none)'}")
        return 0
    if args.model_type is None or args.folder is None:
        parser.error("give MODEL_TYPE and DIR (or --list)")
    try:
        folder = write_tiny_model(args.model_type, args.folder, registry)
    except (PluginError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote the tiny {args.model_type} model to {folder}: [model] type = {args.model_type!r}, path = '{folder}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
