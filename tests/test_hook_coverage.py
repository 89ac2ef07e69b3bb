"""Meta-test: every hook in hookspecs.py is called by the core and exercised by a test.

"Exercised" is read from the test sources (tests/ with the reference plugin, and each plugin's tests/):
a test plugin implements the hook (``@hookimpl`` then ``def <hook>(``, also inside plugin source a test
writes out as a string), or a test calls it (``hook.<hook>(``, ``require("<hook>"`` / ``call(...)`` /
``has(...)``, or a plugin's implementation directly: ``flux.export_model(``). "Called by the core" is read
the same way from diffpipe_core's own modules (without direct calls). Both are static scans: they catch a
hook added without a test, or one the core never calls, not a test that is wrong.
"""

from __future__ import annotations

import re
from pathlib import Path

from diffpipe_core.plugin_guide import hook_specs

ROOT = Path(__file__).resolve().parents[1]
# Declared in the contract but never called by the core yet; listed so the test fails once it is called
# (then remove it here) and so a new uncalled hook is not taken silently.
NOT_CALLED_YET: dict[str, str] = {}  # hook name -> why


def implemented(hook: str, text: str) -> bool:
    return re.search(rf"@hookimpl(\([^)]*\))?\s*\n\s*def {hook}\(", text) is not None


def called(hook: str, text: str) -> bool:
    return (
        re.search(rf"\bhook\.{hook}\(|\b(require|call|has|subset_hook_caller)\(\s*[\"']{hook}[\"']", text) is not None
    )


def called_directly(hook: str, text: str) -> bool:
    """A test calling a plugin's implementation itself: ``flux.export_model(...)``, ``plugin.sample(...)``."""
    return called(hook, text) or re.search(rf"\b\w+\.{hook}\(", text) is not None


def _test_sources() -> list[Path]:
    folders = [ROOT / "tests", *ROOT.glob("diffpipe_*/tests"), *ROOT.glob("plugins/diffpipe_*/tests")]
    return [p for folder in folders for p in folder.rglob("*.py") if "template" not in p.relative_to(ROOT).parts]


def _core_sources() -> list[Path]:
    return [p for p in (ROOT / "diffpipe_core").rglob("*.py") if p.name != "hookspecs.py"]


def uncovered(hooks: list[str], sources: list[Path], check) -> list[str]:
    texts = [p.read_text(encoding="utf-8") for p in sources]
    return [h for h in hooks if not any(check(h, t) for t in texts)]


def test_every_hook_is_exercised_by_a_test() -> None:
    hooks = [name for name, _, _ in hook_specs()]
    missing = uncovered(hooks, _test_sources(), lambda h, t: implemented(h, t) or called_directly(h, t))
    assert set(missing) <= set(NOT_CALLED_YET), f"hooks no test implements or calls: {missing}"


def test_every_hook_is_called_by_the_core() -> None:
    hooks = [name for name, _, _ in hook_specs()]
    missing = uncovered(hooks, _core_sources(), called)
    assert missing == sorted(NOT_CALLED_YET), f"hooks the core never calls: {missing} (expected {NOT_CALLED_YET})"


def test_the_scan_can_fail(tmp_path: Path) -> None:
    plugin = tmp_path / "test_plugin.py"
    plugin.write_text('PLUGIN = """\n@hookimpl(wrapper=True)\ndef on_train_end(run_dir, summary):\n"""\n')
    user = tmp_path / "test_user.py"
    user.write_text(
        'plugin.require("encode_batch", batch=b)\nregistry.pm.hook.register_commands(cli=main)\n'
        "x = flux.export_model(a)\n"
    )
    hooks = ["on_train_end", "encode_batch", "register_commands", "export_model", "on_never_called", "sample"]
    check = lambda h, t: implemented(h, t) or called_directly(h, t)  # noqa: E731
    assert uncovered(hooks, [plugin, user], check) == ["on_never_called", "sample"]
