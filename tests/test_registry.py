"""Acceptance 1: plugin discovery through real entry points, in-process registration, broken plugins."""

from __future__ import annotations

from pathlib import Path

import pytest

import diffpipe_core
from diffpipe_core import ModelConfigBase, ModelSpec, hookimpl
from diffpipe_core.registry import PluginError, Registry
from diffpipe_core.testing.processes import cli_env, run_diffpipe, write_plugin_distribution

GOOD_PLUGIN = """
from diffpipe_core import ModelConfigBase, ModelSpec, hookimpl

class Config(ModelConfigBase):
    pass

@hookimpl
def model_spec():
    return ModelSpec(name="extra", modality="video", config_schema=Config)
"""

BROKEN_PLUGIN = """
raise ImportError("this plugin needs a package that is not installed: flash_attn")
"""


def test_installed_entry_points_are_discovered_and_a_broken_one_is_reported(tmp_path: Path) -> None:
    site = write_plugin_distribution(
        tmp_path / "site",
        "diffpipe-extra",
        {"diffpipe.models": {"extra": "extra_plugin", "broken": "broken_plugin"}},
        {"extra_plugin": GOOD_PLUGIN, "broken_plugin": BROKEN_PLUGIN},
    )
    result = run_diffpipe(["models"], cwd=tmp_path, timeout=120, env=cli_env([site]))
    assert result.returncode == 0, result.output
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert "diffpipe-reference" in lines["reference"] and lines["reference"].rstrip().endswith("ok")
    assert "video" in lines["extra"] and "diffpipe-extra" in lines["extra"] and "0.0.1" in lines["extra"]
    assert "FAILED" in lines["broken"] and "flash_attn" in lines["broken"]


def test_broken_plugin_does_not_hide_others_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = write_plugin_distribution(
        tmp_path / "site",
        "diffpipe-broken",
        {"diffpipe.models": {"broken": "broken_plugin2"}},
        {"broken_plugin2": BROKEN_PLUGIN},
    )
    monkeypatch.syspath_prepend(str(site))
    registry = Registry()
    registry.load_entry_points()
    assert registry.model("reference").spec.modality == "image"
    with pytest.raises(PluginError, match="failed to load.*flash_attn"):
        registry.model("broken")


class _InProcess:
    class Config(ModelConfigBase):
        pass

    @hookimpl
    def model_spec(self) -> ModelSpec:
        return ModelSpec(name="inproc", modality="image", config_schema=self.Config)

    @hookimpl
    def lora_targets(self, model_config):
        return ["inproc_linear"]


def test_in_process_registration_and_per_model_dispatch() -> None:
    registry = Registry()
    registry.load_entry_points()
    registry.register_model("inproc", _InProcess())
    # Each model's hooks are called alone: the reference plugin's lora_targets must not answer for it.
    targets = registry.model("inproc").call("lora_targets", model_config=None)
    assert targets == ["inproc_linear"]
    ref = registry.model("reference")
    assert "to_q" in ref.call("lora_targets", model_config=None)
    assert registry.model("inproc").has("lora_targets") and not registry.model("inproc").has("encode_batch")


def test_generic_plugins_see_calls_of_every_model() -> None:
    seen = []

    class Observer:
        @hookimpl(wrapper=True)
        def lora_targets(self, model_config):
            result = yield
            seen.append(result)
            return result

    registry = Registry()
    registry.load_entry_points()
    registry.register_generic("observer", Observer())
    registry.model("reference").call("lora_targets", model_config=None)
    assert seen and "to_q" in seen[0]


def test_unknown_model_names_installed_models_and_package() -> None:
    registry = Registry()
    registry.load_entry_points()
    with pytest.raises(PluginError) as err:
        registry.model("refernce")
    text = str(err.value)
    assert "Did you mean 'reference'" in text
    installed = text.split("Installed models: ", 1)[1].split(". ", 1)[0].split(", ")  # names may hold dots
    assert "reference" in installed and "refernce" not in installed
    assert "pip install diffpipe-refernce" in text


def test_spec_name_must_match_entry_point() -> None:
    class Misnamed:
        @hookimpl
        def model_spec(self) -> ModelSpec:
            return ModelSpec("other", "image", ModelConfigBase)

    registry = Registry()
    plugin = Misnamed()
    info = registry.register_model("mine", plugin)
    assert not info.ok and "entry point is named 'mine'" in info.error


def test_hookimpl_marker_is_exported() -> None:
    assert diffpipe_core.hookimpl.project_name == "diffpipe"


def test_an_unknown_model_type_names_the_distribution_that_ships_it() -> None:
    """``chroma`` comes in diffpipe-flux and ``qwen-image`` in diffpipe-qwenimage: the hint names those, not a
    ``diffpipe-<type>`` that does not exist; the table covers every model type this checkout installs."""
    from diffpipe_core.registry import DISTRIBUTIONS, PluginError, Registry, get_registry

    for name, distribution in (("chroma", "diffpipe-flux"), ("qwen-image", "diffpipe-qwenimage"), ("mochi", None)):
        with pytest.raises(PluginError, match=f"pip install {distribution or 'diffpipe-' + name}$"):
            Registry().model(name)
    shipped = {p.name: p.distribution for p in get_registry().models() if p.distribution != "diffpipe-reference"}
    assert shipped == {name: DISTRIBUTIONS[name] for name in shipped}, "add the new model type to DISTRIBUTIONS"
