"""What ``validate`` and every command check before any work, beyond the config files themselves: that the
dataset gives enough micro-batches for ``gradient_accumulation_steps``, that the model has enough layers for
``pipeline_stages``, that the optimizer takes its ``kwargs``, and (not a problem, a line to say) how the model
rounds the configured resolutions."""

from __future__ import annotations

from typing import Any

from diffpipe_core.data.dataset_config import DatasetConfig
from diffpipe_core.data.items import ScanResult
from diffpipe_core.types import ModelSpec


def micro_batches_per_rank(scan: ScanResult, run: Any, dp: int) -> int:
    """Micro-batches per epoch on each data-parallel rank, as the sampler cuts them: full ones per micro-batch
    group (bucket and control sizes), each at its bucket's size (``micro_batch_size_per_gpu`` may be per
    resolution)."""
    from diffpipe_core.data.report import group_counts

    return sum(
        n // run.micro_batch_size_for(bucket.width, bucket.height, bucket.frames)
        for (bucket, *_), n in group_counts(scan).items()
    ) // max(1, dp)


def micro_batch_problems(run: Any, scan: ScanResult, dp: int | None, source: str) -> list[str]:
    """``gradient_accumulation_steps`` larger than the micro-batches an epoch gives (``dp``: data-parallel ranks,
    None when unknown: counted for 1, the most an epoch can give)."""
    gas = run.gradient_accumulation_steps
    have = micro_batches_per_rank(scan, run, dp or 1)
    if have >= gas:
        return []
    ranks = f" on each of {dp} data-parallel ranks" if dp and dp > 1 else ""
    mbs = run.micro_batch_size_per_gpu
    of = f" of {mbs}" if isinstance(mbs, int) else ""
    return [
        f"{source}: gradient_accumulation_steps: {gas}, but the dataset gives {have} micro-batch"
        f"{'es' if have != 1 else ''}{of} per epoch{ranks} (one step needs {gas}); lower "
        "gradient_accumulation_steps or micro_batch_size_per_gpu, or add data"
    ]


def layer_problems(cfg: Any, plugin: Any) -> list[str]:
    """``pipeline_stages`` (or ``partition_split``) beyond the model's layers: counted on the model's meta-device
    skeleton (no weights read), for plugins that load per stage; others are checked when the model loads."""
    run = cfg.run
    if run.pipeline_stages == 1 and not run.partition_split and run.sequence_parallel == 1:
        return []
    if not plugin.has("diffusion_model_weights"):
        return []
    import torch

    from diffpipe_core.quiet import library_prints

    with library_prints():
        model = plugin.require(
            "load_diffusion_model", model_config=cfg.model, device=torch.device("meta"), dtype=torch.float32
        )
        layers = plugin.require("split_into_layers", model=model, model_config=cfg.model)
        n = len(layers)
    source = str(cfg.path)
    if run.sequence_parallel > 1:
        from diffpipe_core.engine.sequence_parallel import sequence_problems

        problems = sequence_problems(run.sequence_parallel, layers, plugin.spec)
        if problems:
            return [f"{source}: {p}" for p in problems]
    if run.pipeline_stages > n:
        return [
            f"{source}: pipeline_stages: {run.pipeline_stages}, but model {plugin.name!r} splits into {n} layers; "
            f"use at most {n}"
        ]
    if run.partition_split and run.partition_split[-1] >= n:
        return [f"{source}: partition_split: {run.partition_split} points past the model's {n} layers "
                f"(valid: 1..{n - 1})"]
    return []


def adapter_format_problems(cfg: Any, plugin: Any) -> list[str]:
    """``[adapter] save_formats`` the chosen targets cannot be written in (a fused ``qkv`` with a LoRA on only some of
    q/k/v): each format exported once from the adapter on the model's meta-device skeleton (no weights read), for
    plugins that load per stage; the others find out at the first save."""
    adapter = cfg.run.adapter
    if adapter is None or not [f for f in adapter.save_formats if f != "diffusers"]:
        return []
    if not plugin.has("diffusion_model_weights"):
        return []
    import torch

    from diffpipe_core.adapter_kinds import from_adapter_table, is_adapter_param
    from diffpipe_core.adapters import apply_adapter
    from diffpipe_core.engine.saving import export_adapter_format
    from diffpipe_core.quiet import library_prints

    with library_prints():
        model = plugin.require(
            "load_diffusion_model", model_config=cfg.model, device=torch.device("meta"), dtype=torch.float32
        )
    targets = adapter.target_modules or plugin.require("lora_targets", model_config=cfg.model)
    config = from_adapter_table(adapter, list(targets))
    try:
        apply_adapter(model, config)
    except ValueError as exc:
        return [f"{cfg.path}: adapter.target_modules: {exc}"]
    state = {n.replace(".default", ""): p for n, p in model.named_parameters() if is_adapter_param(n)}
    problems = []
    for fmt in dict.fromkeys(f for f in adapter.save_formats if f != "diffusers"):
        try:
            with torch.device("meta"):
                export_adapter_format(state, plugin, config, fmt)
        except (ValueError, KeyError) as exc:  # the exporter's own verdict; anything else may be meta's doing
            problems.append(f"{cfg.path}: adapter.save_formats: {fmt!r} cannot be written for these targets "
                            f"({type(exc).__name__}: {exc}); adapt every module the format fuses, or remove {fmt!r}")
    return problems


def trained_name_problems(cfg: Any, plugin: Any) -> list[str]:
    """``[model] merge_adapters`` files whose keys are no LoRA of this model, and ``[adapter] exclude_modules`` and
    ``[optimizer] group_lr`` name patterns that match nothing: checked on the model's meta-device skeleton (with
    the adapter applied; no weights read, the merged files' headers only), for plugins that load per stage; the
    others find out when the stage is built."""
    from diffpipe_core.config import is_lr_pattern

    adapter, group_lr, merged = cfg.run.adapter, cfg.run.optimizer.group_lr, cfg.model.merge_adapters
    patterns = any(is_lr_pattern(k) for k in group_lr)
    if not (patterns or merged or (adapter is not None and adapter.exclude_modules)):
        return []
    if not plugin.has("diffusion_model_weights"):
        return []
    import torch

    from diffpipe_core.adapter_kinds import from_adapter_table
    from diffpipe_core.adapters import apply_adapter, excluding
    from diffpipe_core.merge_adapters import adapter_file, native_targets, plan_updates
    from diffpipe_core.optim import unmatched_lr_patterns
    from diffpipe_core.quiet import library_prints

    with library_prints():
        model = plugin.require(
            "load_diffusion_model", model_config=cfg.model, device=torch.device("meta"), dtype=torch.float32
        )
    prefix = plugin.call("adapter_key_prefix") or "transformer"
    for entry in merged:
        try:
            plan_updates(adapter_file(entry.path), [n for n, _ in model.named_modules()], prefix,
                         native_targets(plugin, cfg.model))
        except ValueError as exc:
            return [f"{cfg.path}: {exc}"]
    if adapter is not None:
        targets = adapter.target_modules or plugin.require("lora_targets", model_config=cfg.model)
        try:
            apply_adapter(model, excluding(model, from_adapter_table(adapter, list(targets)), adapter.exclude_modules))
        except ValueError as exc:
            return [f"{cfg.path}: {exc}"]
        names = [n for n, p in model.named_parameters() if p.requires_grad]
    else:
        names = [n for n, p in model.named_parameters() if p.is_floating_point()]
    return [f"{cfg.path}: optimizer.group_lr: pattern {g!r} matches none of the {len(names)} trained parameters "
            f"(e.g. {', '.join(names[:3])})" for g in unmatched_lr_patterns(group_lr, names)]


def optimizer_problems(cfg: Any) -> list[str]:
    """``[optimizer] kwargs`` the optimizer does not take or of the wrong type, and values a plugin's optimizer
    refuses (imports torch only for those or a plugin's optimizer)."""
    from diffpipe_core.optimizer_names import BUILTIN_OPTIMIZERS

    if not cfg.run.optimizer.kwargs and cfg.run.optimizer.type in BUILTIN_OPTIMIZERS:
        return []
    from diffpipe_core.optim import kwargs_problems
    from diffpipe_core.registry import get_registry

    return kwargs_problems(cfg.run.optimizer, get_registry().pm, str(cfg.path))


def frame_notes(dataset: DatasetConfig, spec: ModelSpec) -> list[str]:
    """A line per ``frame_buckets`` with counts above 1 for a model that trains on images only: they change nothing
    (diffusion-pipe's example dataset has ``[1, 33]`` for every model, so this is said, not refused)."""
    if spec.modality != "image":
        return []
    notes = []
    for i, directory in enumerate([dataset, *dataset.directory]):
        counts = [f for f in (directory.frame_buckets or []) if f != 1]
        if counts:
            where = "" if i == 0 else f"directory[{i - 1}]."
            notes.append(f"{dataset.source}: {where}frame_buckets: model {spec.name!r} trains on images only, so "
                         f"{counts} frames change nothing; remove them")
    return notes


def resolution_notes(dataset: DatasetConfig, spec: ModelSpec) -> list[str]:
    """One line per configured resolution the model trains at another size (sizes are rounded down to the
    model's ``spatial_multiple``), saying to what."""
    m = spec.spatial_multiple
    notes: list[str] = []
    seen: set[Any] = set()
    for i in range(len(dataset.directory)):
        for res in dataset.settings_for(i).resolutions:
            if res in seen:
                continue
            seen.add(res)
            w, h = res if isinstance(res, tuple) else (res, res)
            rw, rh = max(m, w // m * m), max(m, h // m * m)
            if (rw, rh) != (w, h):
                given = f"{w}x{h}" if isinstance(res, tuple) else str(res)
                notes.append(
                    f"{dataset.source}: resolutions: {given} is not a multiple of {m} (model {spec.name!r}); "
                    f"training at {rw}x{rh}" + (" and the aspect-ratio buckets of that area" if dataset.settings_for(
                        i).enable_ar_bucket else "")
                )
    return notes
