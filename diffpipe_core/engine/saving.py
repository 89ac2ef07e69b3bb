"""Saving trained adapters and full models from a pipeline whose layers are spread over ranks."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import PeftConfig

from diffpipe_core.adapter_kinds import alpha_and_rank, fold_strength, keyed_format, kind_of, modules_of
from diffpipe_core.adapters import ADAPTER_FILE, diffusers_format, save_adapter
from diffpipe_core.atomic import atomic_save_safetensors, atomic_write_text, replace_dir, space_checked
from diffpipe_core.registry import ModelPlugin


def gather_to_rank0(local: dict[str, torch.Tensor], include: bool) -> dict[str, torch.Tensor] | None:
    """Merge the tensors each contributing rank holds into one dict on rank 0 (None elsewhere)."""
    payload = {k: v.detach().cpu() for k, v in local.items()} if include else {}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return payload
    gathered: list[dict[str, torch.Tensor]] | None = (
        [{} for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    )
    dist.gather_object(payload, gathered, dst=0)
    if gathered is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    return merged


TRAINED_ALPHA = "diffpipe.trained_alpha"  # metadata: the alpha trained with, folded into the saved tensors


def write_adapter(
    out_dir: Path,
    state: dict[str, torch.Tensor],
    plugin: ModelPlugin,
    config: PeftConfig,
    formats: list[str],
    dtype: torch.dtype,
    model_config: Any = None,
) -> list[str]:
    """Rank 0: write the adapter folder atomically in every requested format.

    A format whose export fails is left out and named in the returned list of problems; the others, and
    always the diffusers file, are still written, so a late export bug never costs the trained adapter.
    Every file has the trained strength folded in and alpha = rank (:func:`fold_strength`). With ``model_config``,
    the plugin's ``adapter_parts`` may split the adapter into sub-folders and label every file.
    """
    trained_alpha, _ = alpha_and_rank(config)
    state, config = fold_strength(state, config)
    prefix = plugin.call("adapter_key_prefix") or "transformer"
    parts = plugin.call("adapter_parts", state_dict=state, model_config=model_config) if model_config else None
    problems: list[str] = []
    written: list[tuple[Path, dict[str, dict[str, torch.Tensor]], dict[str, str]]] = []
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    for part, (part_state, labels) in (parts or {"": (state, {})}).items():
        files = _adapter_files(part_state, plugin, config, formats, problems)
        written.append((tmp / part if part else tmp, files, dict(labels)))
    if tmp.exists():
        shutil.rmtree(tmp)
    needed = sum(v.numel() * dtype.itemsize for _, files, _ in written for t in files.values() for v in t.values())
    with space_checked(tmp, needed, f"the adapter {out_dir}", _kept(out_dir)):
        for folder, files, labels in written:
            save_adapter(folder, files, config, dtype, prefix, {TRAINED_ALPHA: f"{trained_alpha:g}", **labels}, labels)
    replace_dir(tmp, out_dir)
    return problems


def _adapter_files(
    state: dict[str, torch.Tensor], plugin: ModelPlugin, config: PeftConfig, formats: list[str], problems: list[str]
) -> dict[str, dict[str, torch.Tensor]]:
    """``{file name: tensors}`` of one adapter in every format (always ``diffusers``); failures go to ``problems``."""
    prefix = plugin.call("adapter_key_prefix") or "transformer"
    files: dict[str, dict[str, torch.Tensor]] = {}
    for fmt in dict.fromkeys(["diffusers", *formats]):
        try:
            exported = export_adapter_format(state, plugin, config, fmt)
        except Exception as exc:
            problems.append(f"adapter format {fmt!r} not written: {type(exc).__name__}: {exc}")
            exported = None
        if exported is None and fmt == "diffusers":
            exported = diffusers_format(state, prefix)
        if exported is not None:
            files[ADAPTER_FILE if fmt == "diffusers" else f"adapter_model.{fmt}.safetensors"] = exported
    return files


def saved_parts(saved: Path) -> list[str]:
    """``<folder>: <label>`` of each adapter part a save labelled ``diffpipe.part`` (:func:`write_adapter`), the save
    folder's own first; empty when none is labelled."""
    from diffpipe_core.adapters import CONFIG_FILE

    found = []
    for config in [saved / CONFIG_FILE, *sorted(saved.glob(f"*/{CONFIG_FILE}"))]:
        try:
            label = json.loads(config.read_text()).get("diffpipe.part")
        except (OSError, ValueError):
            continue
        if label:
            found.append(f"{config.parent.relative_to(saved.parent)}: {label}")
    return found


def export_adapter_format(
    state: dict[str, torch.Tensor], plugin: ModelPlugin, config: PeftConfig, fmt: str
) -> dict[str, torch.Tensor] | None:
    """The adapter ``state`` in ``fmt`` (None for ``diffusers`` when the core writes it); raises when the plugin
    cannot write it. Works on meta tensors too (under ``torch.device("meta")``), as the check before any work
    (:func:`diffpipe_core.preflight.adapter_format_problems`) calls it."""
    export = _lora_file if kind_of(config).name == "lora" else _lycoris_file
    exported = export(state, plugin, config, fmt)
    if exported is None and fmt != "diffusers":
        raise ValueError(f"model {plugin.name!r} cannot export a {kind_of(config).name} in format {fmt!r}")
    return exported


def _lora_file(
    state: dict[str, torch.Tensor], plugin: ModelPlugin, config: PeftConfig, fmt: str
) -> dict[str, torch.Tensor] | None:
    """A LoRA in ``fmt``: the plugin's ``export_adapter`` (None: the core's diffusers layout, for ``diffusers``)."""
    alpha, rank = alpha_and_rank(config)
    return plugin.call("export_adapter", state_dict=state, alpha=alpha, rank=rank, format=fmt)


def _lycoris_file(
    state: dict[str, torch.Tensor], plugin: ModelPlugin, config: PeftConfig, fmt: str
) -> dict[str, torch.Tensor] | None:
    """A LoKr/LoHa in ``fmt``: ``diffusers`` is peft's tensors under the pipeline prefix (the core's, with the
    config in the metadata); another format puts each module under the key stem the plugin's
    ``adapter_key_names`` gives it."""
    if fmt == "diffusers":
        return None
    stems = plugin.call("adapter_key_names", modules=modules_of(state, kind_of(config)), format=fmt)
    return None if stems is None else keyed_format(state, config, stems)
def _kept(out_dir: Path) -> str:
    return f"{out_dir} keeps its previous content" if out_dir.exists() else f"{out_dir} was not written"


SAVED_INDEX = "model.safetensors.index.json"  # the index write_model_shards writes next to its shards


def write_model_shards(
    out_dir: Path,
    local: dict[str, torch.Tensor],
    *,
    rank: int,
    stage_id: int,
    dp_rank: int,
    num_stages: int,
    dtype: torch.dtype,
    barrier: Callable[[], None],
) -> None:
    """Collective: each stage's data-parallel rank 0 writes its own shard (no rank holds the whole
    model); rank 0 writes the index and renames the folder into place."""
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    name = f"model-{stage_id + 1:05d}-of-{num_stages:05d}.safetensors"
    if dp_rank == 0:
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in local.items()}
        needed = sum(t.numel() * t.element_size() for t in tensors.values())
        with space_checked(tmp, needed, f"stage {stage_id}'s shard of {out_dir}", _kept(out_dir)):
            atomic_save_safetensors(tensors, tmp / name, {"format": "pt"})
            atomic_write_text(tmp / f".keys-{stage_id}.json", json.dumps(sorted(tensors)))
    barrier()
    if rank == 0:
        weight_map = {}
        for s in range(num_stages):
            keys_file = tmp / f".keys-{s}.json"
            for key in json.loads(keys_file.read_text()):
                weight_map[key] = f"model-{s + 1:05d}-of-{num_stages:05d}.safetensors"
            keys_file.unlink()
        atomic_write_text(
            tmp / SAVED_INDEX, json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
        )
        replace_dir(tmp, out_dir)
    barrier()


def read_saved_model(saved_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a full fine-tune saved by :func:`write_model_shards`: the
    ``model-0000k-of-0000n.safetensors`` shards that ``model.safetensors.index.json`` names, on the CPU."""
    from safetensors.torch import load_file

    index = Path(saved_dir) / SAVED_INDEX
    if not index.is_file():
        raise FileNotFoundError(f"{index}: not found; expected a full fine-tune saved by diffpipe")
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        file = Path(saved_dir) / shard
        if not file.is_file():
            raise FileNotFoundError(f"{file}: not found; {index} names it as a shard of the saved model")
        state.update(load_file(str(file)))
    return state


def export_model_formats(saved_dir: Path, plugin: ModelPlugin, model_config: Any, formats: list[str]) -> list[str]:
    """Rank 0: the plugin's ecosystem formats of a saved full fine-tune, each in ``saved_dir/<format>``
    (written to a temporary folder first). A format that fails is named in the returned problems; the
    shards and the other formats stay."""
    problems: list[str] = []
    for fmt in formats:
        out = saved_dir / fmt
        tmp = saved_dir / f".tmp-{fmt}"
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            written = plugin.call(
                "export_model", saved_dir=saved_dir, model_config=model_config, out_dir=tmp, format=fmt
            )
            if not written:
                raise ValueError(f"model {plugin.name!r} cannot export format {fmt!r}")
        except Exception as exc:
            problems.append(f"model format {fmt!r} not written: {type(exc).__name__}: {exc}")
            shutil.rmtree(tmp, ignore_errors=True)
            continue
        replace_dir(tmp, out)
    return problems
