"""The plugin guide (plugins/README.md) is generated from the contract and kept fresh; `diffpipe plugin
new` renders ruff-clean Python and refuses what it cannot render. (The rendered packages' own tests, their
install and a 2-stage training run are in test_distributions.py.)"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from diffpipe_core import types
from diffpipe_core.plugin_cli import plugin
from diffpipe_core.plugin_guide import guide_types, hook_specs, refresh_guide, signature_text, types_markdown
from diffpipe_core.scaffold import render_plugin, template_dir

GUIDE = Path(__file__).resolve().parents[1] / "plugins" / "README.md"


def test_guide_is_in_sync() -> None:
    text = GUIDE.read_text()
    assert text == refresh_guide(text), "run: diffpipe plugin guide plugins/README.md"


def test_every_hook_is_documented_in_the_guide() -> None:
    text = GUIDE.read_text()
    specs = hook_specs()
    assert len(specs) >= 18 and "validate_model_files" in {name for name, _, _ in specs}
    for name, fn, _ in specs:
        assert f"\n#### {name}\n" in text, f"hook {name} has no section in {GUIDE}"
        assert signature_text(fn) in text, f"hook {name}'s signature in {GUIDE} is not the one in hookspecs.py"


def test_every_type_field_is_documented_in_the_guide() -> None:
    text = GUIDE.read_text()
    names = [cls.__name__ for cls in guide_types()]
    assert {"ModelSpec", "EncodeBatch", "TrainingContext"} <= set(names), names
    for cls in guide_types():
        name = cls.__name__
        section = text.split(f"\n### {name}\n", 1)[1].split("\n### ", 1)[0]
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in section, f"{name}.{field.name} is missing from {GUIDE}"
    for field in ("supports_lora", "supports_full_finetune", "description", "adapter_formats", "model_formats"):
        assert f"| `{field}` |" in text
    for shape in ("(B, 3, H, W)", "(B, 3, F, H, W)", "(B, 1, H, W)", "same length for every"):
        assert shape in text, shape
    assert "sample_timesteps(n: int, generator: torch.Generator" in text and "in (0, 1)" in text


def test_an_undocumented_field_fails_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass
    class TrainingContext:
        """Facts.

        Attributes:
            step: the step.
        """

        step: int = 0
        secret: int = 1

    TrainingContext.__module__ = types.__name__
    monkeypatch.setattr(types, "TrainingContext", TrainingContext)
    with pytest.raises(ValueError, match=r"TrainingContext\.secret is not described"):
        types_markdown()


def test_guide_command_reports_and_refreshes_a_stale_guide(tmp_path: Path) -> None:
    stale = tmp_path / "README.md"
    stale.write_text(GUIDE.read_text().replace("\n#### encode_batch\n", "\n#### encode_batches\n", 1))
    runner = CliRunner()
    result = runner.invoke(plugin, ["guide", str(stale), "--check"])
    assert result.exit_code == 1 and "stale" in result.output
    result = runner.invoke(plugin, ["guide", str(stale)])
    assert result.exit_code == 0 and "refreshed" in result.output
    assert stale.read_text() == GUIDE.read_text()


def test_a_guide_without_its_hooks_block_is_refused() -> None:
    text = GUIDE.read_text().replace("<!-- generated: hooks -->", "<!-- hooks went missing -->")
    with pytest.raises(ValueError, match="no block for '<!-- generated: hooks -->'"):
        refresh_guide(text)


def test_plugin_new_refuses_bad_names_and_existing_folders(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(plugin, ["new", "My-Model", "--dir", str(tmp_path)])
    assert result.exit_code == 1 and "'My-Model' is not valid" in result.output
    assert not any(tmp_path.iterdir())
    target = render_plugin("mine", tmp_path)
    assert (target / "src" / "diffpipe_mine" / "plugin.py").is_file()
    result = runner.invoke(plugin, ["new", "mine", "--dir", str(tmp_path)])
    assert result.exit_code == 1 and "already exists" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diffpipe-mine"]  # no temporary folder left behind


def test_template_has_no_unknown_placeholder(tmp_path: Path) -> None:
    broken = tmp_path / "template"
    (broken / "src").mkdir(parents=True)
    (broken / "pyproject.toml").write_text('name = "{{distribution}}"\nsize = "{{size}}"\n')
    with pytest.raises(KeyError, match=r"unknown placeholder \{\{size\}\}"):
        render_plugin("mine", tmp_path / "out", template=broken)
    assert not (tmp_path / "out" / "diffpipe-mine").exists()
    assert (template_dir() / "pyproject.toml").is_file()


@pytest.mark.parametrize(("name", "video"), [("mine-too", False), ("a" * 32, True)])  # a '-'; the longest name
def test_rendered_template_is_ruff_clean(tmp_path: Path, name: str, video: bool) -> None:
    """The template is kept out of the repository's ruff run (it holds placeholders); what it renders
    to is checked here under the rendered package's own ruff config."""
    pkg = render_plugin(name, tmp_path, video=video)
    assert "{{" not in "".join(p.read_text() for p in pkg.rglob("*") if p.is_file())
    for args in (["check"], ["format", "--check"]):
        out = subprocess.run(
            [sys.executable, "-m", "ruff", *args, "--no-cache", "."], cwd=pkg, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stdout + out.stderr
    spec = (pkg / "src" / f"diffpipe_{name.replace('-', '_')}" / "plugin.py").read_text()
    assert f'video={"(4, 1, 16.0)" if video else "None"},' in spec  # diffusers_spec: a video model's frame rules


def test_the_guide_shows_the_rendered_template_a_complete_plugin_in_under_150_lines(tmp_path: Path) -> None:
    """The example block is the template's config and plugin modules as rendered (so it is the tested code), and
    it is short: what a diffusers-backed plugin on the shared parts takes."""
    block = GUIDE.read_text().split("<!-- generated: example -->\n", 1)[1].split("<!-- end generated -->", 1)[0]
    pkg = render_plugin("mymodel", tmp_path) / "src" / "diffpipe_mymodel"
    sources = [(pkg / name).read_text() for name in ("config.py", "plugin.py")]
    assert all(f"```python\n{source}```" in block for source in sources)
    assert sum(len(source.splitlines()) for source in sources) < 150
    assert "class Mymodel(DiffusersModel, FlowSampling):" in sources[1] and "@hookimpl" in sources[1]
