"""The GPU-fit table of a model page: the plan :mod:`~diffpipe_core.engine.gpu_fit` picks for 24, 48 and 80 GB at the
model's usual resolutions, for its real size, with no weights and no dataset.

Where each input comes from:

- **the real size**: the plugin's ``plan_size`` declaration (an attribute of the plugin object): ``{component:
  config}`` for the diffusers folder's components whose configs the model and its sampling read (the transformer's
  config from the released model, the VAE's latent channels and levels). A config-only folder is written from it and
  the model built on the meta device from that folder, as ``diffpipe validate`` builds it: nothing is read but
  configs.
- **the resolutions**: the plugin's ``plan_resolutions`` (``[(width, height, frames), ...]``), else the core's
  default per kind, :data:`USUAL`: 512 and 1024 px squares for image models, 512x512x33 and 848x480x81 for video
  models (rounded to the model's spatial and frame multiples).
- **the first layer's inputs** at each resolution: the model's own sampling hooks (``denoise_init`` for the noise
  latents, ``denoise_inputs`` for the layer's inputs) with the text tensors of ``plan_size``'s ``text`` entry
  (``{name: shape without the batch}``: what ``encode_batch`` caches for a caption at the default text length).
- **the run**: a LoRA of rank 32 (AdamW, bf16), micro-batch 1, one GPU, ``[model]`` defaults.

Every figure is an estimate of the stage plan; the table says so until a GPU measurement replaces it.

Building a table takes tens of seconds per model type (a meta forward of the released size at each resolution), so
the tables are generated once and committed: ``<distribution>/fit-tables.json`` holds, per model type, the table
and the :func:`fingerprint` of what it was made from (``plan_size``, the resolutions, the estimator's own modules,
the plugin's module and layer modules as code: their syntax trees without docstrings; the diffusers and peft
versions). ``python -m diffpipe_core.manual --check``
compares fingerprints (fast) and names a stale table; ``python -m diffpipe_core.manual --fit-tables`` rebuilds the
stale ones.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

USUAL: dict[str, list[tuple[int, int, int]]] = {
    "image": [(512, 512, 1), (1024, 1024, 1)],
    "video": [(512, 512, 33), (848, 480, 81)],
}
BUDGETS_GB = (24, 48, 80)
RUN = {"dataset": "dataset.toml", "micro_batch_size_per_gpu": 1, "adapter": {"rank": 32}}


def usual_resolutions(plugin: Any) -> list[tuple[int, int, int]]:
    """The plugin's ``plan_resolutions``, else :data:`USUAL` for its kind, rounded to its spatial and frame
    multiples."""
    spec = plugin.spec
    declared = getattr(plugin.info.module, "plan_resolutions", None)
    out = []
    for w, h, f in declared or USUAL[spec.modality]:
        m = spec.spatial_multiple
        steps = spec.frame_multiple
        frames = f if spec.modality == "image" else steps * ((f - spec.frame_offset) // steps) + spec.frame_offset
        out.append((w // m * m, h // m * m, max(1, frames)))
    return out


def write_plan_folder(plugin: Any, folder: Path) -> dict[str, Any]:
    """A config-only diffusers folder of the model's declared real size (``plan_size``); returns its text entry."""
    size = getattr(plugin.info.module, "plan_size", None)
    if not size:
        raise ValueError(f"model {plugin.name!r} declares no plan_size (its real size), so there is no table")
    folder_spec = plugin.info.module.folder
    index = {"_class_name": folder_spec.pipelines[0]}
    for component, config in size.items():
        if component == "text":
            continue
        (folder / component).mkdir(parents=True, exist_ok=True)
        name = "scheduler_config.json" if component == "scheduler" else "config.json"
        (folder / component / name).write_text(json.dumps(config))
        kind = config.get("_class_name") or folder_spec.components.get(component, "")
        index[component] = ["diffusers", kind if isinstance(kind, str) else kind[0]]
    (folder / "model_index.json").write_text(json.dumps(index))
    return dict(size.get("text", {}))


def _inputs(plugin: Any, model_config: Any, text_shapes: dict[str, Sequence[int]], size: tuple[int, int, int]):
    import torch

    from diffpipe_core.types import SampleRequest

    request = SampleRequest(width=size[0], height=size[1], frames=size[2], steps=2)
    generator = torch.Generator().manual_seed(0)
    latents, schedule = plugin.require("denoise_init", request=request, model_config=model_config, generator=generator)
    text = {k: torch.ones((1, *shape), dtype=torch.bfloat16) for k, shape in text_shapes.items()}  # masks: all kept
    inputs = plugin.require("denoise_inputs", latents=latents, schedule=schedule, index=0, text=text,
                            request=request, model_config=model_config)  # fmt: skip
    return tuple(inputs)


def _count(n: int) -> str:
    return f"{n / 1e9:.1f} B" if n >= 1e8 else f"{n / 1e6:.1f} M"


def _cell(fit: Any) -> str:
    from diffpipe_core.engine.gpu_fit import gib

    if not fit.fits:
        return f"does not fit: needs {gib(fit.peak)} ({gib(fit.shortfall)} short)"
    return f"{fit.choice.describe()}: {gib(fit.peak)}"


def fit_table_markdown(
    model_type: str,
    resolutions: Sequence[tuple[int, int, int]] | None = None,
    budgets_gb: Sequence[float] = BUDGETS_GB,
    registry: Any = None,
) -> str:
    """A Markdown table of the GPU-fit plan for ``model_type`` at its usual resolutions (``resolutions`` to choose)
    for 24, 48 and 80 GB GPUs (``budgets_gb``), one GPU, a rank-32 LoRA at micro-batch 1: per cell the savers picked
    and the estimated peak, or the shortfall. Marked as estimates. Raises ValueError when the plugin declares no
    ``plan_size`` or cannot build its model on the meta device."""
    from diffpipe_core.config import ResolvedConfig, RunConfig
    from diffpipe_core.engine.gpu_fit import FitSource, GiB, fit_source
    from diffpipe_core.registry import get_registry

    registry = registry or get_registry()
    plugin = registry.model(model_type)
    rows = []
    with tempfile.TemporaryDirectory(prefix="diffpipe-plan-") as tmp:
        folder = Path(tmp) / "model"
        text = write_plan_folder(plugin, folder)
        model_config = plugin.spec.config_schema.model_validate({"type": model_type, "path": str(folder)})
        run = RunConfig.model_validate({**RUN, "model": {"type": model_type, "path": str(folder)}})
        cfg = ResolvedConfig(Path(tmp) / "run.toml", run, model_config, {})
        source = None
        for size in resolutions or usual_resolutions(plugin):
            inputs = _inputs(plugin, model_config, text, size)
            source = FitSource(cfg, plugin, inputs=inputs) if source is None else source.with_inputs(inputs)
            label = f"{size[0]}x{size[1]}" + (f"x{size[2]}" if size[2] > 1 else "")
            cells = [_cell(fit_source(source, int(gb * GiB))) for gb in budgets_gb]
            rows.append(f"| {label} | " + " | ".join(cells) + " |")
    params = sum(p.numel() for p in source.model.parameters()) if source is not None else 0
    failed = source.costs(None).failed if source is not None else None
    head = "| resolution | " + " | ".join(f"{gb:g} GB" for gb in budgets_gb) + " |"
    note = (
        f"Estimates (the stage plan's, not yet measured on a GPU): {model_type} at {_count(params)} parameters, "
        "a rank-32 LoRA at micro-batch 1 on one GPU; each cell gives the cheapest savers that fit "
        "(`diffpipe validate --plan --gpu-memory`) and the estimated peak."
    )
    if failed:  # the meta forward stopped: the layers from there count borrowed or no activations
        note += f" Activations only partly estimated: the meta forward failed at {failed.split(':')[0]}."
    return "\n".join([note, "", head, "|" + "---|" * (len(budgets_gb) + 1), *rows]) + "\n"



#: the estimator's modules: a change to any of them can change every table
ESTIMATOR_MODULES = (
    "engine/fit_table.py", "engine/gpu_fit.py", "engine/stage_plan.py", "engine/stage_costs.py",
    "engine/activations.py", "engine/meta_forward.py", "engine/partition.py", "quantize.py",
)  # fmt: skip
TABLES_FILE = "fit-tables.json"


def _plugin_sources(plugin: Any) -> list[Path]:
    """The module defining the plugin's class (or the plugin module) and its package's layer modules."""
    module = plugin.info.module
    source = inspect.getsourcefile(module if inspect.ismodule(module) else type(module))
    if source is None:
        return []
    own = Path(source)
    return [own, *sorted(p for p in own.parent.glob("*layers*.py") if p != own)]


def fingerprint(plugin: Any) -> str:
    """A hash of what ``plugin``'s table is made from (the module docstring's list); no model is built."""
    from importlib.metadata import version

    core = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    declared = {
        "size": getattr(plugin.info.module, "plan_size", None), "resolutions": usual_resolutions(plugin),
        "budgets": BUDGETS_GB, "run": RUN, "versions": [version("diffusers"), version("peft")],
    }  # fmt: skip
    digest.update(json.dumps(declared, sort_keys=True, default=str).encode())
    for path in [*(core / m for m in ESTIMATOR_MODULES), *_plugin_sources(plugin)]:
        digest.update(path.name.encode() + b"\0" + _code_of(path).encode())
    return digest.hexdigest()[:16]


def _code_of(path: Path) -> str:
    """``path``'s code as its syntax tree, docstrings left out: rewording a docstring or a comment, or rewrapping a
    line, leaves every table fresh (each rebuild of them all costs tens of CPU minutes); a changed statement does
    not."""
    import ast

    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):  # fmt: skip
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def read_tables(distribution: Path) -> dict[str, dict[str, str]]:
    """``{model type: {"fingerprint": ..., "table": ...}}`` committed in ``distribution`` (empty when none)."""
    path = distribution / TABLES_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_tables(distribution: Path, tables: dict[str, dict[str, str]]) -> None:
    """Write ``distribution``'s committed tables (atomically, sorted, one type per key)."""
    from diffpipe_core.atomic import atomic_write_text

    atomic_write_text(distribution / TABLES_FILE, json.dumps(tables, indent=1, sort_keys=True) + "\n")
