"""Issue 15, test 4: the CLI and every model plugin's entry-point module import no heavy library.

Checked in a fresh interpreter (``sys.modules``), because this test process has torch loaded already.
"""

from __future__ import annotations

import types
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from diffpipe_core.testing.imports import check_light_imports, heavy_imports

MODEL_ENTRY_POINTS = sorted(entry_points(group="diffpipe.models"), key=lambda ep: ep.name)


def test_cli_imports_no_heavy_library() -> None:
    # importing the CLI also loads every installed plugin (plugin commands) and calls its model_spec
    assert heavy_imports("diffpipe_core.cli") == {}


@pytest.mark.parametrize("ep", MODEL_ENTRY_POINTS, ids=[ep.name for ep in MODEL_ENTRY_POINTS])
def test_plugin_entry_module_imports_no_heavy_library(ep) -> None:
    found = heavy_imports(ep.value, ep.name)  # "module" or "module:object"; model_spec is called too
    assert found == {}, f"{ep.name} ({ep.value}) imports {sorted(found)}: {found}"


def test_kit_names_the_line_that_imports_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The checker goes by module name; an empty stand-in called torch first on the path spares the suite
    # two real torch imports (seconds each) and is detected just the same.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    (tmp_path / "heavy_plugin.py").write_text(
        "from diffpipe_core import ModelConfigBase, ModelSpec, hookimpl\n"
        "import torch\n\n\n"
        "class Cfg(ModelConfigBase):\n    pass\n\n\n"
        "@hookimpl\ndef model_spec():\n    return ModelSpec(name='heavy', modality='image', config_schema=Cfg)\n"
    )
    found = heavy_imports("heavy_plugin", "heavy", extra_paths=[tmp_path])
    assert set(found) == {"torch"}
    assert found["torch"]["stage"] == "importing the module"
    assert found["torch"]["chain"][0] == f"{tmp_path / 'heavy_plugin.py'}:2"

    # the conformance kit's check: by module name, in a fresh interpreter that finds the module on PYTHONPATH
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(AssertionError, match=r"imports torch while importing the module \(.*heavy_plugin.py:2\)"):
        check_light_imports(types.ModuleType("heavy_plugin"), "heavy")
