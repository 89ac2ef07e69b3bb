"""TOML + pydantic validation with errors that name the file, the key path, the bad value and what
would be valid (including a close spelling for a misspelt key)."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

import tomllib
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(Exception):
    """One or more problems in a config file; ``problems`` lists them all."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; a missing file or a syntax error becomes a ConfigError naming it."""
    if not path.is_file():
        raise ConfigError([f"{path}: file not found"])
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: invalid TOML: {exc}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 text: {exc}"]) from None


def _model_at(cls: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """Follow a pydantic error location through nested models to the model holding the last key."""
    current: Any = cls
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(part)
        if field is None:
            return None
        current = _unwrap_model(field.annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap_model(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _unwrap_model(arg)
        if found is not None:
            return found
    return None


def _expected(cls: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    """Human form of the annotation of the field at ``loc``."""
    if not loc:
        return None
    parent = _model_at(cls, loc[:-1]) if len(loc) > 1 else cls
    if parent is None or not isinstance(loc[-1], str):
        return None
    field = parent.model_fields.get(loc[-1])
    if field is None:
        return None
    return describe_type(field.annotation)


_PLURAL = {
    "a table": "tables",
    "an integer": "integers",
    "a number": "numbers",
    "a string": "strings",
    "a path": "paths",
    "a pair of integers": "pairs of integers",
    "a pair of numbers": "pairs of numbers",
}


def describe_type(annotation: Any) -> str:
    """``Literal['a','b'] | None`` -> ``one of 'a', 'b' (or omit it)``, and so on."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return repr(args[0]) if len(args) == 1 else "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        parts = [describe_type(a) for a in args if a is not type(None)]
        text = " or ".join(parts)
        return text + (" (or leave it out)" if type(None) in args else "")
    if origin is tuple and len(args) == 2 and args[0] == args[1]:
        return f"a pair of {_PLURAL.get(describe_type(args[0]), 'values')}"
    if origin in (list, tuple):
        inner = describe_type(args[0]) if args else "values"
        return f"a list of {_PLURAL.get(inner, inner)}"
    if origin is dict or annotation is dict:
        return "a table"
    if isinstance(annotation, type):
        if issubclass(annotation, Path):
            return "a path"
        if issubclass(annotation, BaseModel):
            return "a table"
        return {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}.get(
            annotation.__name__, annotation.__name__
        )
    return str(annotation)


KeyHint = Callable[[str, Any, "list[str]"], "str | None"]
"""``(key path, value, valid keys of its table) -> sentence or None``: what to write instead of a key from another
tool. The path has no list indices (``model.transformer_dtype``, ``directory.skip_empty_caption``)."""


def _field_loc(cls: type[BaseModel], loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """The part of a pydantic error location that names fields and list indices; what follows it are the tags of
    union members (``('activation_checkpointing', 'bool')`` -> ``('activation_checkpointing',)``)."""
    current: Any = cls
    for i, part in enumerate(loc):
        if isinstance(part, int):
            continue
        model = _unwrap_model(current) if current is not cls else cls
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return loc[:i]
        current = model.model_fields[part].annotation
    return loc


def _key_text(prefix: str, loc: tuple[Any, ...]) -> str:
    key = prefix + ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in loc).replace(".[", "[")
    return key.rstrip(".") or "(top level)"


def format_errors(
    exc: ValidationError, cls: type[BaseModel], source: str, prefix: str = "", hints: KeyHint | None = None
) -> list[str]:
    """Turn pydantic's errors into one line each: ``file: key.path: problem``.

    An unknown key that ``hints`` knows (another tool's name for something) gets the hint instead of a spelling
    guess; the valid keys of a table are listed once, with its first unknown key that has no hint. The errors of
    a union's members (``bool | Literal['offload']``) become one line for the key.
    """
    problems = []
    listed: set[tuple[Any, ...]] = set()
    seen_union: set[tuple[Any, ...]] = set()
    for err in exc.errors():
        loc = tuple(err["loc"])
        kind = err["type"]
        if kind != "extra_forbidden":
            field_loc = _field_loc(cls, loc)
            if field_loc != loc:  # one of a union's members: report the key once
                if field_loc in seen_union:
                    continue
                seen_union.add(field_loc)
                loc, kind = field_loc, "union"
        key = _key_text(prefix, loc)
        path = prefix + ".".join(str(p) for p in loc if not isinstance(p, int))
        if kind == "extra_forbidden":
            parent = _model_at(cls, loc[:-1]) if len(loc) > 1 else cls
            valid = sorted(parent.model_fields) if parent else []
            hint = hints(path, err.get("input"), valid) if hints else None
            if hint:
                msg = hint
            else:
                close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
                msg = f"unknown key {str(loc[-1])!r}." + (f" Did you mean {close[0]!r}?" if close else "")
                table = loc[:-1]
                if table not in listed:
                    listed.add(table)
                    msg += f" Valid keys here: {', '.join(valid)}"
                else:
                    msg += " (valid keys listed above)"
        elif kind == "missing":
            msg = "required key is missing"
            expected = _expected(cls, loc)
            if expected:
                msg += f" (expected {expected})"
        elif kind == "union":
            value = err.get("input")
            msg = f"invalid value {value!r}"
            expected = _expected(cls, loc)
            if expected:
                msg += f": expected {expected}"
        else:
            value = err.get("input")
            expected = _expected(cls, loc)
            msg = f"invalid value {value!r}: {err['msg']}"
            if kind == "value_error" and (not loc or value is None):  # a model-level check, or a key left out
                msg = str(err["msg"]).removeprefix("Value error, ")
            if expected and kind not in ("value_error", "assertion_error"):
                msg += f" (expected {expected})"
        if kind != "extra_forbidden" and hints and loc:
            parent = _model_at(cls, loc[:-1]) if len(loc) > 1 else cls
            hint = hints(path, err.get("input"), sorted(parent.model_fields) if parent else [])
            if hint:
                msg += f". {hint}"
        problems.append(f"{source}: {key}: {msg}")
    return problems


def validate(
    cls: type[M],
    data: dict[str, Any],
    source: str,
    prefix: str = "",
    context: Any = None,
    hints: KeyHint | None = None,
) -> M:
    """Validate ``data`` against ``cls``; raise ConfigError listing every problem (see :func:`format_errors`). Numbers
    are strict (see :func:`loose_numbers`): pydantic would quietly turn ``"1e-4"``, ``true`` and ``4.0`` into
    numbers."""
    loose = loose_numbers(cls, data)
    problems = [f"{source}: {prefix}{key}: {msg}" for key, msg in loose]
    try:
        result = cls.model_validate(data, context=context)
    except ValidationError as exc:
        said = tuple(f"{source}: {prefix}{key}: " for key, _ in loose)  # pydantic's word on the same key
        problems += [p for p in format_errors(exc, cls, source, prefix, hints) if not p.startswith(said)]
        raise ConfigError(problems) from None
    if problems:
        raise ConfigError(problems)
    return result


_NUMBERS = (int, float)
_UNION = (typing.Union, getattr(__import__("types"), "UnionType", None))


def _members(annotation: Any) -> list[Any]:
    """The types a field takes (``Optional`` and ``Annotated`` unwrapped, unions flattened)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _members(args[0])
    if origin in _UNION:
        return [t for a in args if a is not type(None) for t in _members(a)]
    return [annotation]


def _is(annotation: Any, kind: type) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, kind) and (kind is bool or annotation is not bool)


def _takes_number_not_string(annotation: Any) -> bool:
    """Whether a field of this type takes numbers and no strings (``float``, ``int | None``; not ``int | str``
    nor ``Literal['auto'] | int``)."""
    kinds = _members(annotation)
    return any(_is(a, _NUMBERS) for a in kinds) and not any(_takes_string(a) for a in kinds)


def _takes_string(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return any(isinstance(a, str) for a in typing.get_args(annotation))
    if origin is not None:
        return False
    return isinstance(annotation, type) and (issubclass(annotation, (str, Path)) or annotation is Any)


def _loose_number(value: Any, annotation: Any) -> str | None:
    """What is wrong with ``value`` for a field that takes numbers, in pydantic's strict mode: a bool is never a number
    and a float is never an integer. None when it is fine or not a number field."""
    kinds = _members(annotation)
    if not any(_is(a, _NUMBERS) for a in kinds) or any(a is Any for a in kinds):
        return None
    expected = describe_type(annotation)
    if isinstance(value, bool):
        if any(_is(a, bool) for a in kinds):
            return None
        return f"invalid value {str(value).lower()}: true/false is not a number; {expected} is expected"
    if isinstance(value, float) and any(_is(a, int) for a in kinds) and not any(_is(a, float) for a in kinds):
        whole = f" (write {int(value)})" if value.is_integer() else ""
        return f"invalid value {value!r}: a fraction, where {expected} is expected{whole}"
    return None


def _items_type(annotation: Any) -> list[Any]:
    """The element types of a list/tuple field (``Optional`` unwrapped); empty for anything else."""
    found = []
    for member in _members(annotation):
        if typing.get_origin(member) in (list, tuple):
            found += [a for a in typing.get_args(member) if a is not Ellipsis]
    return found


def _values_type(annotation: Any) -> Any:
    """The value type of a ``dict[str, X]`` field, or None."""
    for member in _members(annotation):
        if typing.get_origin(member) is dict and len(typing.get_args(member)) == 2:
            return typing.get_args(member)[1]
    return None


def loose_numbers(cls: type[BaseModel], data: Any, path: str = "") -> list[tuple[str, str]]:
    """``(key path, message)`` for every value ``cls`` (and its nested tables) would take as a number only by
    converting it: a string (``lr = "1e-4"``), a bool (``max_steps = true``) or, for an integer, a float
    (``max_steps = 4.0``)."""
    found: list[tuple[str, str]] = []
    if not isinstance(data, dict):
        return found

    def check(value: Any, annotation: Any, key: str) -> None:
        if isinstance(value, str) and _takes_number_not_string(annotation):
            bare = key.rsplit(".", 1)[-1]
            try:
                float(value)
                fix = "; write it without quotes" + ("" if "[" in bare else f" ({bare} = {value})")
            except ValueError:
                fix = ""
            found.append((key, f"invalid value {value!r}: a string, where {describe_type(annotation)} is expected"
                               f"{fix}"))
        elif isinstance(value, (bool, float)):
            problem = _loose_number(value, annotation)
            if problem:
                found.append((key, problem))
        elif isinstance(value, (list, tuple)):
            kinds = _items_type(annotation)
            for i, item in enumerate(value):
                if kinds:
                    check(item, kinds[i] if len(kinds) == len(value) and len(kinds) > 1 else kinds[0], f"{key}[{i}]")
        elif isinstance(value, dict):
            sub = _unwrap_model(annotation)
            if sub is not None:
                found.extend(loose_numbers(sub, value, f"{key}."))
            elif (inner := _values_type(annotation)) is not None:
                for name, item in value.items():
                    check(item, inner, f"{key}.{name}")

    for name, field in cls.model_fields.items():
        key = field.alias or name
        if key in data:
            check(data[key], field.annotation, f"{path}{key}")
    return found


def reference_markdown(cls: type[BaseModel], heading: str, table: str = "", skip: Collection[str] = ()) -> str:
    """A markdown table of every key of ``cls`` (name, type, default, description), less the keys in ``skip``."""
    lines = [f"### {heading}", "", "| key | type | default | description |", "|---|---|---|---|"]
    nested = []
    for name, field in cls.model_fields.items():
        if name in skip:
            continue
        sub = _unwrap_model(field.annotation)
        if sub is not None and sub is not cls:
            nested.append((name, sub))
        default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
        if sub is not None:
            default = "see below" if not field.is_required() else "required"
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        typ = describe_type(field.annotation).replace("|", "\\|")
        lines.append(f"| `{name}` | {typ} | {default} | {desc} |")
    lines.append("")
    for name, sub in nested:
        lines.append(reference_markdown(sub, f"[{table + '.' if table else ''}{name}]", f"{table}.{name}".strip(".")))
    return "\n".join(lines)
