"""Generate the reference parts of the plugin guide (``plugins/README.md``) from the code.

The guide's prose is written by hand; the blocks between ``<!-- generated: NAME -->`` and
``<!-- end generated -->`` are produced here from ``hookspecs.py`` (hook signatures and docstrings),
``types.py`` (``ModelSpec``, ``EncodeBatch``, ``TrainingContext``) and ``diffusion.py``, so the guide
cannot drift from the contract; the example plugin is what ``diffpipe plugin new`` renders (its config and plugin
modules, which the template's own tests run), so the example cannot drift either.
``diffpipe plugin guide plugins/README.md`` refreshes them; a test fails when the file is stale.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from types import ModuleType

BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end generated -->)", re.S)
HOOK_KINDS = (
    ("required", "Model hooks (required)"),
    ("optional", "Model hooks (optional)"),
    ("generic", "Generic hooks (any plugin; every implementation is called)"),
)


def markdown_from_rst(text: str) -> str:
    """The docstrings' reST roles and double backticks as markdown code spans."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def hook_kind(doc: str) -> tuple[str, str]:
    """``(group, label)`` from the docstring's leading tag: ``*model*`` is a required model hook,
    ``*model, optional (sampling)*`` an optional one labelled ``optional (sampling)``; no tag is generic."""
    tag = re.match(r"^\*([^*]+)\*", doc)
    if tag is None or not tag.group(1).startswith("model"):
        return "generic", "generic"
    label = tag.group(1).removeprefix("model").lstrip(", ").strip() or "required"
    return ("optional" if "optional" in label else "required"), label


def hook_specs() -> list[tuple[str, Callable, dict]]:
    """``(name, function, hookspec options)`` for every hook in ``hookspecs.py``, in file order."""
    from diffpipe_core import hookspecs

    out = []
    for name, fn in vars(hookspecs).items():
        opts = getattr(fn, "diffpipe_spec", None)
        if opts is not None and inspect.isfunction(fn):
            out.append((name, fn, opts))
    return out


def signature_text(fn: Callable) -> str:
    """``name(arg: type, ...) -> type`` with the annotations as written in the source."""
    sig = inspect.signature(fn)
    params = []
    for p in sig.parameters.values():
        ann = "" if p.annotation is inspect.Parameter.empty else f": {_ann(p.annotation)}"
        default = "" if p.default is inspect.Parameter.empty else f" = {p.default!r}"
        params.append(f"{p.name}{ann}{default}")
    ret = "" if sig.return_annotation is inspect.Signature.empty else f" -> {_ann(sig.return_annotation)}"
    return f"{fn.__name__}({', '.join(params)}){ret}"


def _ann(annotation: object) -> str:
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def hooks_markdown() -> str:
    specs = hook_specs()
    parts = ["| hook | kind | what it does |", "|---|---|---|"]
    for name, fn, _ in specs:
        doc = inspect.cleandoc(fn.__doc__ or "")
        first = re.sub(r"^\*[^*]+\*\s*", "", doc.split("\n\n")[0]).replace("\n", " ")
        parts.append(f"| [`{name}`](#{name}) | {hook_kind(doc)[1]} | {markdown_from_rst(first)} |")
    for kind, title in HOOK_KINDS:
        parts.append(f"\n### {title}")
        for name, fn, opts in specs:
            doc = inspect.cleandoc(fn.__doc__ or "")
            if hook_kind(doc)[0] != kind:
                continue
            if not doc:
                raise ValueError(f"hookspecs.py: hook {name!r} has no docstring")
            flags = [
                hook_kind(doc)[1],
                "first non-None result wins" if opts.get("firstresult") else "every implementation is called",
            ]
            body = markdown_from_rst(re.sub(r"^\*[^*]+\*\s*", "", doc))
            parts.append(f"\n#### {name}\n\n```python\n{signature_text(fn)}\n```\n")
            parts.append(f"*{'; '.join(flags)}*\n\n{body}")
    return "\n".join(parts) + "\n"


def _attribute_docs(cls: type) -> tuple[str, dict[str, str]]:
    """Split a Google-style class docstring into its prose and ``{field: text}`` from ``Attributes:``."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    prose, _, attrs = doc.partition("\nAttributes:\n")
    fields: dict[str, str] = {}
    current: list[str] = []
    for line in attrs.splitlines():
        m = re.match(r"^ {4}(\w[\w /]*):\s(.*)$", line)
        if m:
            current = [n.strip() for n in m.group(1).split("/")]
            for n in current:
                fields[n] = m.group(2).strip()
        elif line.strip() and current:
            for n in current:
                fields[n] += " " + line.strip()
    return prose.strip(), fields


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f"`{f.default_factory()!r}`"  # type: ignore[misc]
    return "required"


def guide_types() -> list[type]:
    """Every dataclass defined in ``types.py`` (``ModelSpec``, ``EncodeBatch``, ``TrainingContext``, ...), in
    file order: all of them cross the plugin boundary."""
    from diffpipe_core import types

    return [
        cls
        for cls in vars(types).values()
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == types.__name__
    ]


def types_markdown() -> str:
    parts = []
    for cls in guide_types():
        name = cls.__name__
        prose, docs = _attribute_docs(cls)
        parts.append(f"\n### {name}\n\n{markdown_from_rst(prose)}\n")
        parts += ["| field | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if f.name not in docs:
                raise ValueError(f"types.py: {name}.{f.name} is not described in the class docstring's Attributes")
            ftype = _ann(f.type).replace("|", "\\|")
            text = markdown_from_rst(docs[f.name]).replace("|", "\\|")
            parts.append(f"| `{f.name}` | `{ftype}` | {_default_text(f)} | {text} |")
    return "\n".join(parts).lstrip("\n") + "\n"


def diffusion_markdown() -> str:
    from diffpipe_core import diffusion

    parts = [markdown_from_rst(inspect.cleandoc(diffusion.__doc__ or "")) + "\n"]
    for name, fn in _public_functions(diffusion):
        doc = markdown_from_rst(inspect.cleandoc(fn.__doc__ or ""))
        if not doc:
            raise ValueError(f"diffusion.py: {name} has no docstring")
        parts.append(f"```python\n{signature_text(fn)}\n```\n{doc}\n")
    return "\n".join(parts)


def _public_functions(module: ModuleType) -> list[tuple[str, Callable]]:
    return [
        (n, f)
        for n, f in vars(module).items()
        if inspect.isfunction(f) and not n.startswith("_") and f.__module__ == module.__name__
    ]


EXAMPLE_NAME = "mymodel"
EXAMPLE_FILES = ("config.py", "plugin.py")


def example_files() -> dict[str, str]:
    """``{file: source}`` of the plugin ``diffpipe plugin new mymodel`` renders (an image model)."""
    import tempfile
    from pathlib import Path

    from diffpipe_core.scaffold import render_plugin

    with tempfile.TemporaryDirectory() as tmp:
        pkg = render_plugin(EXAMPLE_NAME, Path(tmp)) / "src" / f"diffpipe_{EXAMPLE_NAME}"
        return {name: (pkg / name).read_text(encoding="utf-8") for name in EXAMPLE_FILES}


def example_markdown() -> str:
    files = example_files()
    lines = sum(len(source.splitlines()) for source in files.values())
    parts = [
        f"`diffpipe plugin new {EXAMPLE_NAME}` renders these two modules, {lines} lines together: the whole plugin "
        "beside the model's own code (`model.py`, a diffusers `ModelMixin`, and `layers.py`, its pipeline layers; "
        "for a model diffusers has, name its class and drop `model.py`):\n"
    ]
    for name, source in files.items():
        parts.append(f"`src/diffpipe_{EXAMPLE_NAME}/{name}`:\n\n```python\n{source}```\n")
    return "\n".join(parts)


SECTIONS: dict[str, Callable[[], str]] = {
    "example": example_markdown,
    "hooks": hooks_markdown,
    "types": types_markdown,
    "diffusion": diffusion_markdown,
}


def refresh_guide(text: str) -> str:
    """``text`` with every generated block replaced by its current content.

    Raises ValueError when a block names an unknown section or a section's block is missing, so a guide
    cannot silently lose its hook reference.
    """
    seen: list[str] = []

    def fill(m: re.Match) -> str:
        name = m.group(2)
        if name not in SECTIONS:
            raise ValueError(f"unknown generated block {name!r}; valid: {', '.join(SECTIONS)}")
        seen.append(name)
        return f"{m.group(1)}{SECTIONS[name]()}{m.group(4)}"

    out = BLOCK.sub(fill, text)
    missing = [n for n in SECTIONS if n not in seen]
    if missing:
        raise ValueError("the guide has no block for " + ", ".join(f"'<!-- generated: {n} -->'" for n in missing))
    return out


def reference_markdown() -> str:
    """The generated parts alone (what ``diffpipe plugin guide`` prints without a file)."""
    return "\n".join(
        [
            "## Hooks\n",
            hooks_markdown(),
            "## Types\n",
            types_markdown(),
            "## diffpipe_core.diffusion\n",
            diffusion_markdown(),
        ]
    )
