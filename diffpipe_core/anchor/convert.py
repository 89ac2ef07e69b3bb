"""``diffpipe import-config``: a diffusion-pipe run config (and the dataset configs it names) as diffpipe files.

Every key goes through :func:`diffpipe_core.anchor.keys.changes_for`; the written files say, in a comment above
the key, what changed (its name, value, section or file) and why, and list each key that could not be carried.
Values diffpipe needs and the anchor config does not give (a diffusers folder for a model diffusion-pipe loads
from separate files) are written as ``# TODO`` lines and listed by the command.

diffusion-pipe resolves relative paths from the folder it runs in; diffpipe from the folder of the file naming
them. The importer resolves them against ``anchor_dir`` (the current directory by default) and writes them
absolute.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffpipe_core.anchor.keys import (
    Change,
    Context,
    changes_for,
    is_secret,
    toml_key,
    toml_value,
)
from diffpipe_core.anchor.models import ANCHOR_DEFAULTS, CHECKPOINT_PARTS, diffpipe_model
from diffpipe_core.schema import ConfigError, read_toml

TABLES = ("model", "adapter", "optimizer")  # the anchor's tables that keep their name
OUT_TABLES = (*TABLES, "logging")  # run.toml's tables the importer writes
RUN_FILE = "run.toml"
DATASET_FILE = "dataset.toml"


@dataclass
class _Section:
    """The lines of one TOML table being written: keys with the comments above them, and comment-only notes."""

    header: str | None
    lines: list[tuple[str | None, Any, list[str]]] = field(default_factory=list)

    def put(self, key: str, value: Any, notes: list[str]) -> None:
        for k, v, existing in self.lines:
            if k == key:
                if isinstance(v, dict) and isinstance(value, dict):  # group_lr from several anchor keys
                    v.update(value)
                    existing.extend(n for n in notes if n not in existing)
                elif v != value:
                    existing.append(f"(also from {', '.join(notes) or 'another key'}: {toml_value(value)}; kept this)")
                else:
                    existing.extend(n for n in notes if n not in existing)
                return
        self.lines.append((key, value, notes))

    def note(self, text: str) -> None:
        self.lines.append((None, None, [text]))

    def has(self, key: str) -> bool:
        return any(k == key for k, _, _ in self.lines)

    def render(self) -> list[str]:
        out = [self.header] if self.header else []
        for key, value, notes in self.lines:
            out += [f"# {n}" for n in notes]
            if key is not None:
                out.append(f"{toml_key(key)} = {toml_value(value)}")
        return out


@dataclass
class Imported:
    """What :func:`import_config` made: file name -> text, the counts of what happened, and the TODOs."""

    files: dict[str, str]
    counts: Counter
    todo: list[str]
    sources: list[Path]


class _Converter:
    def __init__(self, path: Path, anchor_dir: Path, dataset: Path | None) -> None:
        self.path, self.anchor_dir, self.dataset_override = path, anchor_dir, dataset
        self.counts: Counter = Counter()
        self.todo: list[str] = []
        self.datasets: dict[str, tuple[dict[str, _Section], list[_Section], Path | None]] = {}
        self.sources = [path]

    # ----------------------------------------------------------------------------------------- helpers
    def _resolve(self, value: Any) -> tuple[Any, str | None]:
        if not isinstance(value, str) or not value:
            return value, None
        p = Path(value).expanduser()
        if p.is_absolute():
            return str(p), None
        resolved = str((self.anchor_dir / p).resolve())
        return resolved, f"relative to {self.anchor_dir}, where diffusion-pipe ran"

    def _apply(
        self,
        key: str,
        value: Any,
        changes: list[Change],
        here: str,
        targets: dict[str, _Section],
        moved_label: str = "",
    ) -> None:
        """Write ``changes`` of the anchor's ``key = value`` (from section ``here``) into ``targets``."""
        if isinstance(value, dict):
            original = f"[{key}]"
        else:
            original = key if is_secret(key) else f"{key} = {toml_value(value)}"
        if not any(c.carried or c.needs_input for c in changes):
            why = "; ".join(c.why for c in changes if c.why)
            targets[here].note(f"not carried: {original}" + (f" ({why})" if why else ""))
            self.counts["not carried"] += 1
            return
        for c in changes:
            if c.needs_input:
                target = f"{c.section}.{c.key}" if c.section in OUT_TABLES else str(c.key)
                self.todo.append(f"{target}: {c.why}")
                self.counts["needs input"] += 1
                if c.value is None:
                    targets[c.section].note(f"TODO: {c.key} = ... ({c.why}; diffusion-pipe had {original})")
                else:  # kept as diffusion-pipe had it, so that validate stops at it until it is changed
                    targets[c.section].put(str(c.key), c.value, [f"TODO: {c.why}"])
                continue
            if not c.carried:
                continue
            new_value, path_note = self._resolve(c.value) if c.is_path else (c.value, None)
            main = None
            if c.section != here:
                main = f"moved here: diffusion-pipe had {original}{moved_label}"
                self.counts["moved"] += 1
            elif c.key != key or c.value != value or path_note:
                main = f"was {original}"
                self.counts["changed"] += 1
            else:
                self.counts["as is"] += 1
            if path_note:
                main = f"{main} ({path_note})"
            notes = [n for n in (main, c.why) if n]
            targets[c.section].put(str(c.key), new_value, notes)

    # ----------------------------------------------------------------------------------------- run config
    def convert(self) -> Imported:
        raw = read_toml(self.path)
        model_table = raw.get("model") if isinstance(raw.get("model"), dict) else {}
        ctx = Context(anchor=raw, table=raw)
        run = {s: _Section(None if s == "run" else f"[{s}]") for s in ("run", *OUT_TABLES)}
        data = {"dataset": _Section(None), "directory": _Section(None)}
        model_name = self._model_type(model_table, ctx, run["model"], raw)
        for key, value in raw.items():
            if key in TABLES:
                continue
            if key == "dataset":
                self._dataset(value, run["run"], data, ctx)
            elif key == "eval_datasets":
                self._eval_datasets(value, run["run"], ctx)
            else:
                ctx.table = raw
                targets = {**run, **data}
                self._apply(key, value, changes_for("run", key, value, ctx), "run", targets, " in its run config")
        first = "eval_before_first_step"
        if raw.get("eval_datasets") and first not in raw and ctx.has("run", first):
            run["run"].put(first, True, ["diffusion-pipe's default (diffpipe's is false)"])
            self.counts["changed"] += 1
        for table in TABLES:
            anchor_table = raw.get(table)
            if isinstance(anchor_table, dict):
                ctx.table = anchor_table
                for key, value in anchor_table.items():
                    if table == "model" and key == "type":
                        continue
                    self._apply(key, value, changes_for(table, key, value, ctx), table, run)
        if isinstance(raw.get("adapter"), dict) and "dtype" not in raw["adapter"] and ctx.has("adapter", "dtype"):
            dtype = model_table.get("dtype")
            if dtype in ("float32", "bfloat16", "float16"):
                note = "diffusion-pipe's default: the model's dtype (diffpipe's: float32)"
                run["adapter"].put("dtype", dtype, [note])
                self.counts["changed"] += 1
        checkpoint = model_table.get("diffusion_model")
        parts = CHECKPOINT_PARTS.get(model_name or "", {}) if isinstance(checkpoint, str) else {}
        for key, why in parts.items():
            if key not in model_table and not run["model"].has(key) and ctx.has("model", key):
                value, path_note = self._resolve(checkpoint)
                run["model"].put(key, value, [f"{why} ({path_note})" if path_note else why])
                self.counts["changed"] += 1
        for key, (value, why) in ANCHOR_DEFAULTS.get(model_name or "", {}).items():
            if key not in model_table and not run["model"].has(key):
                run["model"].put(key, value, [why])
                self.counts["changed"] += 1
        self._required_model_keys(model_name, run["model"])
        if DATASET_FILE not in self.datasets:
            note = "TODO: diffusion-pipe's config names no dataset; fill this one in"
            run["run"].put("dataset", DATASET_FILE, [note])
            self.todo.append(f"{DATASET_FILE}: diffusion-pipe's config names no dataset; add [[directory]] entries")
            self.counts["needs input"] += 1
            self.datasets[DATASET_FILE] = (data, [], None)
        files = {RUN_FILE: self._render_run(run)}
        files.update({name: self._render_dataset(*parts) for name, parts in self.datasets.items()})
        return Imported(files, self.counts, self.todo, self.sources)

    def _model_type(self, table: dict[str, Any], ctx: Context, section: _Section, raw: dict[str, Any]) -> str | None:
        from diffpipe_core.registry import get_registry

        anchor_type = table.get("type")
        if not isinstance(anchor_type, str):
            section.note("TODO: type = ... (diffusion-pipe's [model] had no type; `diffpipe models` lists them)")
            self.todo.append("model.type: diffusion-pipe's [model] had no type")
            return None
        registry = get_registry()
        installed = {info.name: info for info in registry.models() if info.ok}
        choice = diffpipe_model(anchor_type, table, self._uses_control(raw), self.anchor_dir)
        name = choice.name or anchor_type
        notes = [f"was type = {toml_value(anchor_type)}" + (f": {choice.why}" if choice.why else "")]
        notes = notes if name != anchor_type else []
        notes += [choice.path_note] if choice.path_note else []
        if name in installed:
            schema = installed[name].spec.config_schema
            ctx.fields["model"] = set(schema.model_fields)
            ctx.model_label = f"diffpipe's {name!r} model"
            self.counts["changed" if notes else "as is"] += 1
        else:
            if choice.planned:
                what = (f"diffpipe has no {anchor_type!r} model yet; the {choice.planned} distribution will have it "
                        "(install it once released)")
            elif choice.name:
                what = f"the {name!r} model's plugin is not installed (`diffpipe models` lists what is)"
            else:
                listing = ", ".join(sorted(installed)) or "none"
                what = f"no diffpipe model plugin is named {name!r} (installed: {listing})"
            notes.append(f"{what}; keys are carried under their own names unchecked")
            self.todo.append(f"model.type: {what}")
            self.counts["needs input"] += 1
        section.put("type", name, notes)
        return name if name in installed else None

    def _uses_control(self, raw: dict[str, Any]) -> bool:
        """Whether the run's dataset config gives control_path (diffusion-pipe then trains edit pairs). A dataset
        that cannot be read here is reported where it is converted."""
        try:
            source = self.dataset_override or self._find(raw.get("dataset"), "dataset")
            data = read_toml(source)
        except ConfigError:
            return False
        entries = data.get("directory") if isinstance(data.get("directory"), list) else []
        return any(isinstance(e, dict) and "control_path" in e for e in entries)

    @staticmethod
    def _cached(schema: Any) -> Path | None:
        """The Hugging Face cache's snapshot of the model's published repository, when this machine has one."""
        from diffpipe_core.component_files import cached_snapshot

        try:
            return cached_snapshot(getattr(schema, "hub_repos", ()), "")
        except ValueError:
            return None

    def _required_model_keys(self, model_name: str | None, section: _Section) -> None:
        """Required ``[model]`` keys the anchor config gave no value for: TODOs with the key's description."""
        if model_name is None:
            return
        from diffpipe_core.registry import get_registry

        schema = get_registry().model(model_name).spec.config_schema
        for key, info in schema.model_fields.items():
            if key == "path" and not section.has(key) and self._cached(schema):
                section.note(f"path: not given: the configs and tokenizers come from {self._cached(schema)}, the "
                             "Hugging Face cache's snapshot of the model")  # fmt: skip
                continue
            needed = info.is_required() or (key == "path" and "hub_repos" in dir(schema))
            if needed and not section.has(key):
                what = (info.description or "required").split(". ")[0].rstrip(".")
                section.note(f"TODO: {key} = ... ({what}; diffusion-pipe's config gives no such value)")
                self.todo.append(f"model.{key}: {what}")
                self.counts["needs input"] += 1

    # ----------------------------------------------------------------------------------------- datasets
    def _find(self, value: Any, what: str) -> Path:
        if not isinstance(value, str):
            raise ConfigError([f"{self.path}: {what}: expected a path, got {value!r}"])
        p = Path(value).expanduser()
        tried = [p] if p.is_absolute() else [self.anchor_dir / p, self.path.parent / p]
        for candidate in tried:
            if candidate.is_file():
                return candidate.resolve()
        raise ConfigError(
            [f"{self.path}: {what}: file not found: tried {', '.join(str(t) for t in tried)}; give --anchor-dir "
             "(the folder diffusion-pipe ran in) or --dataset"]
        )

    def _dataset(self, value: Any, section: _Section, moved: dict[str, _Section], ctx: Context) -> None:
        source = self.dataset_override.resolve() if self.dataset_override else self._find(value, "dataset")
        self.datasets[DATASET_FILE] = self._convert_dataset(source, moved, ctx)
        note = f"was dataset = {toml_value(value)}: {source}, converted into this folder"
        section.put("dataset", DATASET_FILE, [note])
        self.counts["changed"] += 1

    def _eval_datasets(self, value: Any, section: _Section, ctx: Context) -> None:
        if not isinstance(value, list):
            section.note(f"not carried: eval_datasets = {toml_value(value)} (expected a list)")
            self.counts["not carried"] += 1
            return
        entries = []
        for i, entry in enumerate(value):
            name, config = (f"eval{i}", entry) if isinstance(entry, str) else (entry.get("name"), entry.get("config"))
            source = self._find(config, f"eval_datasets[{i}].config")
            file = f"eval-{name}.dataset.toml"
            self.datasets[file] = self._convert_dataset(source, None, ctx)
            entries.append({"name": name, "config": file})
        shown = toml_value(value) if len(toml_value(value)) < 200 else "..."
        section.put("eval_datasets", entries, [f"was eval_datasets = {shown}: each converted into this folder"])
        self.counts["changed"] += 1

    def _convert_dataset(
        self, source: Path, moved: dict[str, _Section] | None, ctx: Context
    ) -> tuple[dict[str, _Section], list[_Section], Path]:
        """The sections of a dataset TOML (rendered at the end: run keys may still move into ``moved``)."""
        self.sources.append(source)
        raw = read_toml(source)
        top = moved if moved is not None else {"dataset": _Section(None), "directory": _Section(None)}
        ctx.table = raw
        for key, value in raw.items():
            if key == "directory":
                continue
            self._apply(key, value, changes_for("dataset", key, value, ctx), "dataset", top)
        directories = []
        used: set[str] = set()
        entries = raw.get("directory") if isinstance(raw.get("directory"), list) else []
        for entry in entries:
            section = _Section("[[directory]]")
            ctx.table = {**raw, **entry}
            for key, value in entry.items():
                self._apply(key, value, changes_for("directory", key, value, ctx), "directory",
                            {"directory": section, "dataset": top["dataset"]})
            for key, value, notes in top["directory"].lines:  # top-level defaults diffpipe sets per directory
                if key is not None and not section.has(key):
                    section.put(key, value, notes)
                    used.add(key)
            directories.append(section)
        for key, value, _ in top["directory"].lines:
            if key is not None and key not in used:
                top["dataset"].note(f"not carried: {key} = {toml_value(value)} (every [[directory]] sets its own)")
                self.counts["moved"] -= 1
                self.counts["not carried"] += 1
        return top, directories, source

    # ----------------------------------------------------------------------------------------- output
    def _render_run(self, run: dict[str, _Section]) -> str:
        lines = [
            f"# diffpipe run config written by `diffpipe import-config` from diffusion-pipe's {self.path}.",
            "# A comment above a key says what changed and why; keys without one are as they were.",
        ]
        if self.todo:
            lines.append("# TODO before training: " + "; ".join(self.todo))
        lines.append("")
        lines += run["run"].render()
        for table in OUT_TABLES:
            if run[table].lines:
                lines += ["", *run[table].render()]
        return "\n".join(lines) + "\n"

    def _render_dataset(
        self, top: dict[str, _Section], directories: list[_Section], source: Path | None = None
    ) -> str:
        origin = f"from diffusion-pipe's {source}" if source else "(diffusion-pipe's run config gave no dataset)"
        lines = [
            f"# diffpipe dataset config written by `diffpipe import-config` {origin}.",
            "# A comment above a key says what changed and why; keys without one are as they were.",
            "",
            *top["dataset"].render(),
        ]
        for section in directories:
            lines += ["", *section.render()]
        if not directories:
            lines += ["", "# TODO: add [[directory]] entries (path = a folder of media and captions)"]
        return "\n".join(lines) + "\n"


def import_config(
    path: Path | str, anchor_dir: Path | str | None = None, dataset: Path | str | None = None
) -> Imported:
    """Convert a diffusion-pipe config (and its dataset configs) into diffpipe file texts; nothing is written."""
    path = Path(path).resolve()
    base = Path(anchor_dir).resolve() if anchor_dir else Path.cwd()
    return _Converter(path, base, Path(dataset) if dataset else None).convert()


def write_imported(imported: Imported, out_dir: Path, force: bool = False) -> list[Path]:
    """Write the files into ``out_dir`` (atomically); refuse to overwrite unless ``force``, and never the input."""
    from diffpipe_core.atomic import atomic_write_text

    out_dir = out_dir.resolve()
    targets = [out_dir / name for name in imported.files]
    for target in targets:
        if target in imported.sources:
            raise ConfigError([f"{target}: is a diffusion-pipe config being imported; choose another --out"])
        if target.exists() and not force:
            raise ConfigError([f"{target}: already exists; choose another --out or pass --force to replace it"])
    out_dir.mkdir(parents=True, exist_ok=True)
    for target, text in zip(targets, imported.files.values()):
        atomic_write_text(target, text)
    return targets
