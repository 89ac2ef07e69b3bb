"""Issue 48: every fenced command (``bash``) and TOML block of the manual is checked against the code, or marked as
not runnable with the reason.

The pages checked: README.md, the hand-written pages of docs/, the plugin guide and each plugin's README (the
sources of the generated model pages). A TOML block must parse, and each of its tables may hold only keys its schema
has (run.toml's, a model plugin's ``[model]`` schema, the dataset TOML's; a ``[model]`` without ``type`` takes any
installed model's keys). A command line runs a ``diffpipe`` command and options that exist (``--help`` of it is
real), a script or module of this repository, or a known shell tool. A block this cannot check is marked, on the line
before its fence, ``<!-- docs-check: not run: REASON -->``; ``<!-- docs-check: python runs in tests/FILE.py ... -->``
names the test that runs a block (which must exist and read the page).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import typing
from pathlib import Path
from typing import Any

import click
import pytest
import tomllib
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[a-z]*)\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)
MARK = re.compile(r"<!-- docs-check: (?P<what>[^>]*?) -->\s*$")
SHELL_TOOLS = {"cd", "export", "ls", "cat", "mkdir", "source", ".", "hf", "huggingface-cli", "tensorboard", "wandb",
               "srun", "sbatch", "torchrun", "git", "pip", "pytest", "echo", "du", "nvidia-smi"}  # fmt: skip


def pages() -> list[Path]:
    hand = [p for p in sorted((REPO / "docs").glob("*.md")) if p.name not in ("config.md", "plugin-guide.md")]
    readmes = [*REPO.glob("diffpipe_*/README.md"), *REPO.glob("plugins/diffpipe_*/README.md")]
    return [REPO / "README.md", *hand, REPO / "plugins" / "README.md", *sorted(readmes)]


def blocks(page: Path) -> list[tuple[int, str, str, str | None]]:
    """``(line, language, body, the docs-check mark before it)`` of each fenced block of ``page``."""
    text = page.read_text()
    out = []
    for match in FENCE.finditer(text):
        line = text[: match.start()].count("\n") + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        body = "\n".join(x[len(match.group("indent")) :] for x in match.group("body").splitlines())
        out.append((line, match.group("lang"), body, mark.group("what") if mark else None))
    return out


def checked_blocks() -> list[tuple[str, str, str, str | None]]:
    return [(f"{p.relative_to(REPO)}:{line}", lang, body, mark) for p in pages() for line, lang, body, mark in
            blocks(p) if lang in ("bash", "sh", "toml")]  # fmt: skip


# ------------------------------------------------------------------------------------------------ TOML
def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (directly, optional, or as list items), if any."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
        for inner in typing.get_args(arg):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


def unknown_keys(table: dict, schema: type[BaseModel] | set[str], where: str) -> list[str]:
    fields = schema if isinstance(schema, set) else set(schema.model_fields) | {
        f.alias for f in schema.model_fields.values() if f.alias}  # fmt: skip
    problems = [f"{where}{key}" for key in table if key not in fields]
    if isinstance(schema, set):
        return problems
    for key, value in table.items():
        sub = _model_of(schema.model_fields[key].annotation) if key in schema.model_fields else None
        if sub is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict):
                problems += unknown_keys(item, sub, f"{where}{key}.")
    return problems


def model_schema(table: dict) -> type[BaseModel] | set[str]:
    from diffpipe_core.registry import get_registry

    registry = get_registry()
    if "type" in table:
        return registry.model(table["type"]).spec.config_schema
    return {k for info in registry.models() if info.ok for k in info.spec.config_schema.model_fields}


def toml_problems(body: str) -> list[str]:
    from diffpipe_core.config import RunConfig
    from diffpipe_core.data.dataset_config import DatasetConfig, DirectoryConfig

    data = tomllib.loads(body)
    if "project" in data:  # a plugin's pyproject.toml: its entry points are installed model types
        from diffpipe_core.registry import get_registry

        names = {info.name for info in get_registry().models() if info.ok}
        points = data["project"].get("entry-points", {}).get("diffpipe.models", {})
        return [f"entry point {name} is not an installed model" for name in points if name not in names]
    dataset_only = set(data) <= set(DatasetConfig.model_fields) - set(RunConfig.model_fields)
    if (
        "directory" in data
        or "resolutions" in data
        or dataset_only
        or set(data) <= set(DirectoryConfig.model_fields) - {"path"}
    ):
        if set(data) <= set(DirectoryConfig.model_fields) | {"directory"} and "directory" not in data:
            return unknown_keys(data, DirectoryConfig, "[[directory]].")
        return unknown_keys(data, DatasetConfig, "")
    problems = []
    if isinstance(data.get("model"), dict):
        problems += unknown_keys(data["model"], model_schema(data["model"]), "[model].")
    rest = {k: v for k, v in data.items() if k != "model"}
    return problems + unknown_keys(rest, RunConfig, "")


# ------------------------------------------------------------------------------------------------ commands
def command_lines(body: str) -> list[str]:
    joined = body.replace("\\\n", " ")
    lines = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            lines += [part.strip() for part in re.split(r"&&|\|\||;|\|", line) if part.strip()]
    return lines


def command_problem(line: str) -> str | None:
    from diffpipe_core.cli import main

    words = shlex.split(line)
    while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value before the command
        words = words[1:]
    if not words:
        return None
    program, args = words[0], words[1:]
    if program.endswith("/diffpipe") or program == "diffpipe":
        command: click.Command = main
        while isinstance(command, click.Group) and args and not args[0].startswith("-"):
            sub = command.get_command(click.Context(command), args[0])
            if sub is None:
                return f"no command `diffpipe ... {args[0]}`"
            command, args = sub, args[1:]
        names = {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        names |= {o for p in main.params for o in p.opts}
        bad = [a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] not in names]
        return f"`{line}`: {command.name} has no option {bad}" if bad else None
    if program == "bash":
        script = next((a for a in args if not a.startswith("-")), None)
        return None if script and (REPO / script).is_file() else f"`{line}`: no script {script}"
    if program.startswith("python") or program.endswith("/python"):
        if args[:1] == ["-m"]:
            module = args[1]
            return None if importlib.util.find_spec(module) else f"`{line}`: no module {module}"
        script = args[0] if args else None
        return None if script and (REPO / script).is_file() else f"`{line}`: no script {script}"
    if program in SHELL_TOOLS or program.startswith((".venv/bin/", "./")):
        return None
    return f"`{line}`: {program} is not a command this test knows (mark the block: <!-- docs-check: not run: ... -->)"


def test_the_pages_have_blocks_to_check() -> None:
    found = checked_blocks()
    assert len(found) > 40 and any(lang == "toml" for _, lang, _, _ in found)


@pytest.mark.parametrize("where,lang,body,mark", checked_blocks(), ids=[b[0] for b in checked_blocks()])
def test_every_command_and_toml_block_is_checked_or_marked(where: str, lang: str, body: str, mark: str | None) -> None:
    if mark is not None:
        if mark.startswith("not run:"):
            assert len(mark.removeprefix("not run:").strip()) > 10, f"{where}: say why the block is not run"
            return
        test = re.search(r"runs in (tests/[\w/]+\.py)", mark)
        assert test and (REPO / test.group(1)).is_file(), f"{where}: {mark!r} names no test that exists"
        page = where.rsplit(":", 1)[0]
        assert page in (REPO / test.group(1)).read_text() or Path(page).name in (REPO / test.group(1)).read_text(), (
            f"{where}: {test.group(1)} does not read {page}"
        )
        return
    if lang == "toml":
        problems = toml_problems(body)
    else:
        problems = [p for line in command_lines(body) if (p := command_problem(line))]
    assert not problems, f"{where}: {problems}"


def test_a_stale_key_or_option_is_caught() -> None:
    """The checks can fail: a misspelt key, a [model] key of no plugin, an option no command has."""
    assert toml_problems("epochz = 1\n[optimizer]\ntype = 'adamw'\nlrr = 1") == ["epochz", "optimizer.lrr"]
    assert toml_problems("[model]\ntype = 'flux'\nno_such_key = 1") == ["[model].no_such_key"]
    assert toml_problems("resolutions = [512]\n[[directory]]\npath = 'x'\nnum_repeat = 2") == ["directory.num_repeat"]
    assert "no option ['--resum']" in command_problem("diffpipe train --config run.toml --resum")
    assert "no command" in command_problem("diffpipe trian --config run.toml")
    assert command_problem("python -m diffpipe_core.testing.no_such_module x") is not None
