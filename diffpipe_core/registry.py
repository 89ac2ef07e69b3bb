"""Plugin discovery (entry-point group ``diffpipe.models``) and per-model hook dispatch."""

from __future__ import annotations

import difflib
import importlib.metadata as metadata
import traceback
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pluggy

from diffpipe_core import CONTRACT_VERSION, __version__, hookspecs
from diffpipe_core.types import ModelSpec

ENTRY_POINT_GROUP = "diffpipe.models"
PLUGIN_GROUP = "diffpipe.plugins"  # generic (non-model) plugins


class PluginError(Exception):
    """A plugin is missing, broken, or does not fulfil the contract."""


@dataclass
class PluginInfo:
    """One discovered plugin: its name, where it came from, and whether it loaded."""

    name: str
    distribution: str | None
    version: str | None
    module: ModuleType | Any | None = None
    error: str | None = None
    spec: ModelSpec | None = None
    is_model: bool = True

    @property
    def ok(self) -> bool:
        return self.error is None


DISTRIBUTIONS = {
    "flux": "diffpipe-flux",
    "flux-kontext": "diffpipe-flux",
    "chroma": "diffpipe-flux",
    "flux2": "diffpipe-flux",
    "flux2-klein": "diffpipe-flux",
    "flux3": "diffpipe-flux",
    "flux3-distilled": "diffpipe-flux",
    "sdxl": "diffpipe-sdxl",
    "hunyuan-video": "diffpipe-hunyuan",
    "hunyuan-video-1.5": "diffpipe-hunyuan",
    "hunyuan-video-1.5-i2v": "diffpipe-hunyuan",
    "hunyuan-image-2.1": "diffpipe-hunyuan",
    "ltx-video": "diffpipe-ltx",
    "ltx-2": "diffpipe-ltx",
    "ltx-2.3": "diffpipe-ltx",
    "ltx-2.5": "diffpipe-ltx",
    "cosmos": "diffpipe-cosmos",
    "cosmos-predict2": "diffpipe-cosmos",
    "cosmos-predict2.5": "diffpipe-cosmos",
    "anima": "diffpipe-cosmos",
    "wan": "diffpipe-wan",
    "wan-i2v": "diffpipe-wan",
    "wan-flf2v": "diffpipe-wan",
    "wan-ti2v": "diffpipe-wan",
    "skyreels-v2": "diffpipe-wan",
    "skyreels-v2-i2v": "diffpipe-wan",
    "wan-vace": "diffpipe-wan",
    "wan-fun": "diffpipe-wan",
    "qwen-image": "diffpipe-qwenimage",
    "qwen-image-edit": "diffpipe-qwenimage",
    "qwen-image-2.1": "diffpipe-qwenimage",
    "qwen-image-2.1-turbo": "diffpipe-qwenimage",
    "z-image": "diffpipe-zimage",
    "sd3": "diffpipe-sd3",
    "auraflow": "diffpipe-auraflow",
    "krea2": "diffpipe-krea",
    "krea2-turbo": "diffpipe-krea",
    "lumina2": "diffpipe-lumina",
    "ideogram4": "diffpipe-ideogram",
    "hidream": "diffpipe-hidream",
    "omnigen2": "diffpipe-omnigen",
    "ernie-image": "diffpipe-ernie",
    "minimax-h3": "diffpipe-minimax",
}
"""The distribution each model type diffpipe ships comes in (several types share one family's distribution), for
the hint an unknown model type gets; any other name is guessed as ``diffpipe-<name>``."""


class Registry:
    """Holds the pluggy manager, the model plugins by name and the ones that failed to load."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("diffpipe")
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.clashes: list[str] = []  # one line per name two installed plugins claim (plugin_clashes.py)

    # ------------------------------------------------------------------ registration
    def register_model(
        self, name: str, plugin: ModuleType | Any, distribution: str | None = None, version: str | None = None
    ) -> PluginInfo:
        """Register a model plugin object (module or instance) under ``name``; used by entry-point
        discovery and by tests alike."""
        info = PluginInfo(name, distribution, version, module=plugin)
        try:
            self.pm.register(plugin, name=f"model:{name}")
            spec = self.pm.subset_hook_caller("model_spec", self._other_models(name))()
            if not isinstance(spec, ModelSpec):
                raise PluginError(f"model_spec() returned {type(spec).__name__}, expected ModelSpec")
            if spec.name != name:
                raise PluginError(f"model_spec().name is {spec.name!r} but the entry point is named {name!r}")
            if spec.contract > CONTRACT_VERSION:
                raise PluginError(
                    f"model plugin {name!r} needs plugin contract {spec.contract}, but this diffpipe-core "
                    f"({__version__}) implements contract {CONTRACT_VERSION}: upgrade diffpipe-core (its CHANGELOG.md "
                    "says what each contract version added)"
                )
            info.spec = spec
        except Exception as exc:  # a broken plugin must not take the others down
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            info.module = None
            info.error = f"{type(exc).__name__}: {exc}"
        self.plugins[name] = info
        return info

    def register_generic(self, name: str, plugin: ModuleType | Any) -> None:
        """Register a non-model plugin (logger, optimizer provider, commands)."""
        self.pm.register(plugin, name=f"plugin:{name}")
        self.plugins[name] = PluginInfo(name, None, None, module=plugin, is_model=False)

    def load_entry_points(self) -> None:
        """Import every installed plugin; record failures instead of raising. Names two plugins claim (a model, a
        distribution, a package) become :attr:`clashes`, and the other plugins load as usual."""
        from diffpipe_core import plugin_clashes as clash

        entries = clash.plugin_entries(metadata.entry_points(group=ENTRY_POINT_GROUP))
        chosen, same_names = clash.choose_models(entries, DISTRIBUTIONS)
        shared = clash.shared_packages(entries)
        self.clashes = [
            *same_names.values(), *clash.replaced_distributions(entries, DISTRIBUTIONS), *clash.package_lines(shared)
        ]
        for name in set(same_names) - {e.name for e in chosen}:
            self.plugins[name] = PluginInfo(name, None, None, error=same_names[name])
        generic = clash.plugin_entries(metadata.entry_points(group=PLUGIN_GROUP))
        for entry, is_model in [*((e, True) for e in chosen), *((e, False) for e in generic)]:
            try:
                module = entry.entry_point.load()
            except Exception as exc:
                tb = traceback.format_exception_only(type(exc), exc)[-1].strip() + _newer_core_hint(exc)
                if entry.package in shared:
                    tb += f" (package {entry.package} is installed by {' and '.join(shared[entry.package])})"
                info = PluginInfo(entry.name, entry.distribution, entry.version, error=tb, is_model=is_model)
                self.plugins[entry.name] = info
                continue
            if is_model:
                self.register_model(entry.name, module, entry.distribution, entry.version)
            else:
                self.register_generic(entry.name, module)

    # ------------------------------------------------------------------ lookup
    def models(self) -> list[PluginInfo]:
        return sorted((p for p in self.plugins.values() if p.is_model), key=lambda p: p.name)

    def model(self, name: str) -> ModelPlugin:
        """The hook caller for one model; a helpful error if it is unknown or broken."""
        info = self.plugins.get(name)
        if info is None or not info.is_model:
            installed = [p.name for p in self.models() if p.ok]
            close = difflib.get_close_matches(name, installed, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            listing = ", ".join(installed) if installed else "none"
            raise PluginError(
                f"unknown model {name!r}.{hint} Installed models: {listing}. "
                f"Model plugins are separate packages: pip install {DISTRIBUTIONS.get(name, f'diffpipe-{name}')}"
            )
        if not info.ok:
            raise PluginError(
                f"model plugin {name!r} ({info.distribution or 'in-process'}) failed to load: {info.error}"
            )
        return ModelPlugin(self, info)

    def _other_models(self, name: str) -> list[Any]:
        return [p.module for n, p in self.plugins.items() if p.is_model and p.ok and n != name and p.module is not None]


class ModelPlugin:
    """Calls one model plugin's hooks (plus every generic plugin's wrappers)."""

    def __init__(self, registry: Registry, info: PluginInfo) -> None:
        self.registry = registry
        self.info = info
        self._exclude = registry._other_models(info.name)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def spec(self) -> ModelSpec:
        assert self.info.spec is not None
        return self.info.spec

    @property
    def version(self) -> str:
        return self.info.version or "0"

    def has(self, hook: str) -> bool:
        """Whether this model (not another model) implements ``hook``."""
        impls = getattr(self.registry.pm.hook, hook).get_hookimpls()
        return any(impl.plugin is self.info.module for impl in impls)

    def takes(self, hook: str, argument: str) -> bool:
        """Whether this model's implementation of ``hook`` declares ``argument`` (pluggy passes only those)."""
        impls = getattr(self.registry.pm.hook, hook).get_hookimpls()
        return any(impl.plugin is self.info.module and argument in impl.argnames for impl in impls)

    def call(self, hook: str, **kwargs: Any) -> Any:
        return self.registry.pm.subset_hook_caller(hook, self._exclude)(**kwargs)

    def require(self, hook: str, **kwargs: Any) -> Any:
        """Call a hook the contract needs; a clear error if the plugin returns nothing."""
        result = self.call(hook, **kwargs)
        if result is None:
            raise PluginError(f"model plugin {self.name!r} does not implement required hook {hook!r}")
        return result


def _newer_core_hint(exc: Exception) -> str:
    """A plugin that fails to import a name from ``diffpipe_core`` was most likely written for a newer core."""
    if isinstance(exc, (ImportError, AttributeError)) and "diffpipe_core" in str(exc):
        return (
            f" (the plugin may need a newer diffpipe-core: this one, {__version__}, implements plugin contract "
            f"{CONTRACT_VERSION}; see its CHANGELOG.md)"
        )
    return ""


_default: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry with installed entry points loaded."""
    global _default
    if _default is None or refresh:
        _default = Registry()
        _default.load_entry_points()
    return _default
