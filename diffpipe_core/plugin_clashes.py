"""Two installed plugins that claim the same name: a model name, a distribution name, or a package.

Each clash becomes one line naming the distributions and the name; the registry keeps every other plugin working,
and ``diffpipe`` prints the lines before any command (``diffpipe models`` among them).
"""

from __future__ import annotations

import importlib.metadata as metadata
from collections.abc import Iterable
from dataclasses import dataclass

#: how a third-party plugin names itself so that it clashes with nothing diffpipe ships (the plugin guide says so)
NAMING = (
    "a third-party plugin needs names of its own: distribution diffpipe-<org>-<model>, package diffpipe_<org>_<model>, "
    "model <org>-<model>"
)


@dataclass(frozen=True)
class PluginEntry:
    """One installed entry point (``diffpipe.models`` or ``diffpipe.plugins``) and the distribution it comes from."""

    name: str
    target: str
    distribution: str | None
    version: str | None
    entry_point: metadata.EntryPoint

    @property
    def package(self) -> str:
        return self.target.split(":")[0].split(".")[0]

    @property
    def origin(self) -> str:
        return f"{self.distribution or 'an unnamed distribution'} {self.version or ''}".strip()


def plugin_entries(entry_points: Iterable[metadata.EntryPoint]) -> list[PluginEntry]:
    """The entry points with their distributions' names and versions."""
    out = []
    for ep in entry_points:
        dist = getattr(ep, "dist", None)
        name = dist.metadata["Name"] if dist is not None else None
        out.append(PluginEntry(ep.name, ep.value, name, dist.version if dist is not None else None, ep))
    return out


def choose_models(entries: list[PluginEntry], shipped: dict[str, str]) -> tuple[list[PluginEntry], dict[str, str]]:
    """The entries to load, and a line per model name that several distributions declare: the distribution diffpipe
    ships that model in keeps it; with none of them diffpipe's, neither is loaded (which one would win is not
    defined)."""
    by_name: dict[str, list[PluginEntry]] = {}
    for entry in entries:
        by_name.setdefault(entry.name, []).append(entry)
    chosen, lines = [], {}
    for name, group in by_name.items():
        if len({e.distribution for e in group}) == 1:
            chosen.append(group[0])
            continue
        origins = " and ".join(sorted(e.origin for e in group))
        ours = [e for e in group if e.distribution == shipped.get(name)]
        if ours:
            chosen.append(ours[0])
            using = f"using {ours[0].distribution}'s (diffpipe ships it); {NAMING}"
        else:
            using = "neither is loaded: uninstall one, or rename its entry point"
        lines[name] = f"model {name!r} is declared by {origins}: {using}"
    return chosen, lines


def replaced_distributions(entries: list[PluginEntry], shipped: dict[str, str]) -> list[str]:
    """A line per distribution installed under the name of one diffpipe ships that lacks models diffpipe's has: pip
    keeps one distribution per name, so another plugin of that name replaced diffpipe's."""
    provided: dict[str, set[str]] = {}
    versions: dict[str, str | None] = {}
    for entry in entries:
        if entry.distribution is not None:
            provided.setdefault(entry.distribution, set()).add(entry.name)
            versions[entry.distribution] = entry.version
    lines = []
    for dist, names in sorted(provided.items()):
        missing = sorted(t for t, d in shipped.items() if d == dist and t not in names)
        if missing:
            lines.append(
                f"{dist} {versions[dist] or ''} provides {', '.join(sorted(names))} but not {', '.join(missing)}, "
                f"which diffpipe's {dist} does: another plugin was installed under diffpipe's distribution name and "
                f"replaced it (pip keeps one per name); reinstall {dist}, and {NAMING}"
            )
    return lines


def shared_packages(entries: list[PluginEntry]) -> dict[str, list[str]]:
    """``{package: distributions}`` for each top-level package of a model entry point that two or more plugin
    distributions install (their files overwrite each other's)."""
    owners: dict[str, set[str]] = {}
    for entry in entries:
        dist = getattr(entry.entry_point, "dist", None)
        if dist is None or entry.distribution is None:
            continue
        for package in _top_packages(dist):
            owners.setdefault(package, set()).add(entry.distribution)
    wanted = {e.package for e in entries}
    return {p: sorted(d) for p, d in sorted(owners.items()) if p in wanted and len(d) > 1}


def package_lines(shared: dict[str, list[str]]) -> list[str]:
    return [
        f"package {package} is installed by {' and '.join(dists)}: their files overwrite each other, so their models "
        f"may fail to load; {NAMING}"
        for package, dists in shared.items()
    ]


def _top_packages(dist: metadata.Distribution) -> set[str]:
    """The top-level import names a distribution installs (``top_level.txt``, else its file list)."""
    text = dist.read_text("top_level.txt")
    if text:
        return {line.strip() for line in text.splitlines() if line.strip()}
    tops = set()
    for file in dist.files or ():
        top = file.parts[0] if file.parts else ""
        if top and not top.endswith((".dist-info", ".egg-info", ".pth", ".data")) and top != "__pycache__":
            tops.add(top.removesuffix(".py"))
    return tops
