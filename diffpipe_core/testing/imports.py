"""Fast start: which heavy libraries a module pulls in when a fresh interpreter imports it.

``diffpipe --help``, ``models`` and ``validate`` import every installed model plugin, so a plugin's entry-point
module, its ``model_spec`` hook and its config schema must not import torch, diffusers or transformers at top
level (torch alone takes seconds to import). The conformance kit calls :func:`check_light_imports`; tests of
the core use :func:`heavy_imports` directly.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

from diffpipe_core.registry import ENTRY_POINT_GROUP
from diffpipe_core.testing.contract_changes import since

HEAVY = ("torch", "deepspeed", "diffusers", "transformers", "peft")

# Runs in the fresh interpreter: records, for each heavy top-level package, the first import of it and the
# chain of source lines that led there; then imports the module, calls model_spec and imports the schema.
_PROBE = r"""
import importlib, json, sys, traceback
target, model, heavy = sys.argv[1], sys.argv[2], set(json.loads(sys.argv[3]))
first, stage = {}, ["importing the module"]

class Watch:
    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top in heavy and top not in first:
            frames = [f for f in traceback.extract_stack()[:-1]
                      if not f.filename.startswith("<") and "importlib" not in f.filename]
            chain = [f"{f.filename}:{f.lineno}" for f in frames][:4]
            first[top] = {"stage": stage[0], "chain": chain}
        return None

sys.meta_path.insert(0, Watch())
module, _, attr = target.partition(":")
plugin = importlib.import_module(module)
for part in filter(None, attr.split(".")):
    plugin = getattr(plugin, part)
if model:
    from diffpipe_core.registry import Registry
    stage[0] = "calling model_spec"
    info = Registry().register_model(model, plugin)
    if info.spec is None:
        raise SystemExit(f"model_spec failed: {info.error}")
    stage[0] = "importing the config schema"
    importlib.import_module(info.spec.config_schema.__module__)
print("\n" + json.dumps(first))
"""


def heavy_imports(
    target: str,
    model_name: str | None = None,
    heavy: Sequence[str] = HEAVY,
    extra_paths: Sequence[Path] = (),
    timeout: float = 180,
) -> dict[str, dict[str, Any]]:
    """Import ``target`` (a module, or ``module:object`` as an entry point names a plugin) in a fresh
    interpreter; then, with ``model_name``, register it as that model plugin, which calls its ``model_spec``,
    and import its config schema's module.

    Returns ``{package: {"stage": when, "chain": ["file:line", ...]}}`` for each of ``heavy`` that got imported,
    the chain running from the outermost source line to the import. ``{}`` is a light module.
    """
    env = dict(os.environ)
    if extra_paths:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, extra_paths), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.Popen(
        [sys.executable, "-c", _PROBE, target, model_name or "", json.dumps(list(heavy))],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"importing {target} in a fresh interpreter took over {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise AssertionError(f"importing {target} in a fresh interpreter failed:\n{err.strip()[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


@functools.cache
def _check_target(target: str, model_name: str, root: str | None = None) -> None:
    found = heavy_imports(
        target, model_name, heavy=("torch", "diffusers", "transformers"), extra_paths=[Path(root)] if root else ()
    )
    if found:
        lines = [f"{pkg} while {where['stage']} ({' -> '.join(where['chain'])})" for pkg, where in found.items()]
        raise AssertionError(
            f"model plugin {model_name!r}: a fresh interpreter imports {', '.join(lines)}. The entry-point module "
            f"{target}, its model_spec and its config schema must import no torch, diffusers or transformers at top "
            "level (diffpipe --help / models / validate import every plugin): use `from __future__ import "
            "annotations`, typing.TYPE_CHECKING imports for annotations, and import heavy modules inside the hooks "
            "that use them" + since("fast_start")
        )


def check_light_imports(plugin_obj: Any, model_name: str) -> None:
    """Assert that a model plugin's entry-point module, ``model_spec`` and config schema import none of torch,
    diffusers or transformers, in a fresh interpreter (checked once per plugin per process).

    What is imported is what the installed entry point ``model_name`` names (``module`` or ``module:object``);
    without one, ``plugin_obj`` itself if it is a module, or ``module:name`` when the module that defines
    ``plugin_obj``'s class holds it as ``name`` (``plugin = Flux()``). Any other object registered in-process by a
    test cannot be re-created in another interpreter and is not checked.
    """
    ep = next((e for e in entry_points(group=ENTRY_POINT_GROUP) if e.name == model_name), None)
    if ep is not None:
        _check_target(ep.value, model_name)
    elif isinstance(plugin_obj, ModuleType):
        _check_target(plugin_obj.__name__, model_name, _import_root(plugin_obj))
    else:
        module = sys.modules.get(type(plugin_obj).__module__)
        name = next((k for k, v in vars(module).items() if v is plugin_obj), None) if module is not None else None
        if name:
            _check_target(f"{module.__name__}:{name}", model_name, _import_root(module))


def _import_root(module: ModuleType) -> str | None:
    """The ``sys.path`` folder ``module`` was imported from (so a fresh interpreter finds a package that a test put
    on ``sys.path`` rather than installed)."""
    file = getattr(module, "__file__", None)
    if not file:
        return None
    depth = module.__name__.count(".") + (1 if Path(file).name == "__init__.py" else 0)
    return str(Path(file).resolve().parents[depth])
