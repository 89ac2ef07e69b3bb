"""What an outside author hit writing a Stable Diffusion 3.5 plugin from the guide, the template and the kit
(issue 36), each fixed and checked here.

The kit's sample comparison runs on ``tests/fixtures/diffpipe-auraflow``: the template rendered for
``AuraFlowPipeline`` (a model the repository does not ship) with only its declarations filled in and its layers
written for diffusers' ``AuraFlowTransformer2DModel``; its own tests (the rendered ones) pass the kit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from diffpipe_core import hookimpl
from diffpipe_core.scaffold import render_plugin
from diffpipe_core.testing.conformance import check_model_plugin

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "diffpipe-auraflow"
GUIDE = (ROOT / "plugins" / "README.md").read_text()
CAPTIONS = ["a red cat", "a blue dog"]


@pytest.fixture(scope="module")
def auraflow(tmp_path_factory: pytest.TempPathFactory):
    """The rendered AuraFlow plugin (imported from the fixture's ``src``) and its tiny model folder."""
    sys.path.insert(0, str(FIXTURE / "src"))
    try:
        from diffpipe_auraflow.plugin import plugin
        from diffpipe_auraflow.testing import write_tiny_model

        yield plugin, write_tiny_model(tmp_path_factory.mktemp("auraflow") / "model")
    finally:
        sys.path.remove(str(FIXTURE / "src"))


def _kit(plugin, folder: Path) -> None:
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(plugin, "auraflow", {"type": "auraflow", "path": str(folder)}, pixels, CAPTIONS)


# ------------------------------------------------------------ 1. a wrong sampling schedule passes the kit
def test_the_kit_compares_the_sample_with_the_pipelines_and_names_the_schedules(
    auraflow, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flux's ``flow_sigmas`` instead of the folder's scheduler (the SD3.5 author's mistake) fails the kit, which
    shows both schedules and names the helper to use; the rendered plugin as it is (stepped_schedule) passes."""
    from diffpipe_core.sampling.schedules import flow_sigmas

    plugin, folder = auraflow
    flux_schedule = type(plugin).denoise_init

    def with_flux_sigmas(self, request, model_config, generator):
        noise, _ = flux_schedule(self, request, model_config, generator)
        return noise, flow_sigmas(request.steps, model_config.shift)

    monkeypatch.setattr(type(plugin), "denoise_init", hookimpl(with_flux_sigmas))
    with pytest.raises(AssertionError) as failed:
        _kit(plugin, folder)
    message = str(failed.value)
    assert "AuraFlowPipeline" in message and "the latents differ" in message, message
    assert "is not the pipeline's sigmas" in message and "stepped_schedule" in message, message
    monkeypatch.undo()
    _kit(plugin, folder)


def test_the_kit_names_the_timestep_when_the_schedules_agree(auraflow, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin that gives the model its timestep on another scale (0..1000 instead of 0..1) samples wrong with the
    right schedule: the kit says the schedules agree and points at denoise_inputs."""
    plugin, folder = auraflow
    right = type(plugin).denoise_inputs

    def thousandfold(self, latents, schedule, index, text, request, model_config):
        x, t, embeds = right(self, latents, schedule, index, text, request, model_config)
        return x, t * 1000, embeds

    monkeypatch.setattr(type(plugin), "denoise_inputs", hookimpl(thousandfold))
    with pytest.raises(AssertionError, match=r"the schedules agree.*denoise_inputs"):
        _kit(plugin, folder)


def test_the_fixture_is_the_template_with_declarations_filled_in(tmp_path: Path) -> None:
    """Against a fresh rendering: every hook body of plugin.py is the template's (only the declarations above the
    hooks differ), config.py is unchanged, model.py is gone (a diffusers class is named), and the plugin with its
    schema is at most 150 lines."""
    fresh = render_plugin("auraflow", tmp_path) / "src" / "diffpipe_auraflow"
    ours = FIXTURE / "src" / "diffpipe_auraflow"
    hooks = "    # ------------------------------------------------------------------------------------------ caching"
    for name in ("plugin.py",):
        theirs_text, ours_text = (fresh / name).read_text(), (ours / name).read_text()
        assert hooks in ours_text
        assert ours_text.split(hooks)[1] == theirs_text.split(hooks)[1], "a hook body differs from the template's"
    assert (ours / "config.py").read_text() == (fresh / "config.py").read_text()
    assert (fresh / "model.py").is_file() and not (ours / "model.py").exists()
    lines = sum(len((ours / f).read_text().splitlines()) for f in ("plugin.py", "config.py"))
    assert lines <= 150, lines


def test_the_template_samples_with_the_folders_scheduler(tmp_path: Path) -> None:
    """The template (and the guide's complete plugin, generated from it) takes the model folder's own scheduler,
    not Flux's schedule, and declares the pipeline its samples must equal."""
    source = (render_plugin("sched-check", tmp_path) / "src" / "diffpipe_sched_check" / "plugin.py").read_text()
    assert "stepped_schedule(" in source and "schedule_time(" in source and "flow_sigmas" not in source
    assert "sample_pipeline = SAMPLE_PIPELINE" in source
    assert "stepped_schedule" in GUIDE.split("## A complete plugin")[1].split("## Declare what differs")[0]
    sampling = GUIDE.split("### Sampling")[1].split("\n## ")[0]
    assert sampling.index("scheduler_sigmas") < sampling.index("flow_sigmas"), "the guide leads with Flux's schedule"
    assert "stepped_schedule" in sampling and "sample_pipeline" in sampling


def test_the_guides_flow_sigmas_figures_are_sd3s_and_fluxs(tmp_path: Path) -> None:
    """The guide's figures: 8 steps at shift 3, the last two sigmas of an SD3 folder's scheduler against
    ``flow_sigmas``."""
    from diffpipe_core.sampling.schedules import flow_sigmas, scheduler_sigmas
    from diffpipe_core.testing import tiny

    tiny.flow_scheduler(shift=3.0).save_pretrained(str(tmp_path / "scheduler"))
    sd3, flux = scheduler_sigmas(tmp_path, 8)[-3:-1].tolist(), flow_sigmas(8, 3.0)[-3:-1].tolist()
    assert f"{sd3[0]:.4f}, {sd3[1]:.4f}" == "0.3380, 0.0089" and f"{flux[0]:.1f}, {flux[1]:.1f}" == "0.5, 0.3"
    assert "SD3's last sigmas are 0.3380, 0.0089; these 0.5, 0.3" in GUIDE


# ------------------------------------------------------------ 2. names without their module or form
def _public_functions() -> dict[str, set[str]]:
    """``{function name: modules}`` of every public function defined in diffpipe_core."""
    import importlib
    import inspect

    found: dict[str, set[str]] = {}
    for file in sorted((ROOT / "diffpipe_core").rglob("*.py")):
        if "plugin_template" in file.parts:
            continue
        name = ".".join(file.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        module = importlib.import_module(name)
        for fname, fn in vars(module).items():
            if inspect.isfunction(fn) and fn.__module__ == name and not fname.startswith("_"):
                found.setdefault(fname, set()).add(name)
    return found


def test_every_function_the_guide_calls_is_named_with_its_module() -> None:
    """A core function the guide shows as a call (`` `text_pipeline(...)` ``) is named with its module in the same
    paragraph, as ``module.function`` or in the paragraph's ``from module import``: an author need not grep."""
    import re

    functions = _public_functions()
    paragraphs = re.split(r"\n\s*\n", GUIDE)
    unnamed = []
    for paragraph in paragraphs:
        for name in sorted(set(re.findall(r"`([a-z_][a-z0-9_]*)\(", paragraph))):
            modules = functions.get(name, set())
            if modules and not any(m in paragraph or f"{m}.{name}" in GUIDE for m in modules):
                unnamed.append(f"{name} ({' or '.join(sorted(modules))})")
    assert not unnamed, f"the guide calls these without their module: {unnamed}"


def test_every_declaration_the_guide_names_is_shown_in_its_form() -> None:
    """Each ``DiffusersModel`` declaration the guide names appears at least once as an assignment (``name = ...``),
    so its form (a tuple of component names, a dict, a string) is shown, not left to guess."""
    import re

    from diffpipe_core.parts.plugin import DiffusersModel

    named = [n for n in DiffusersModel.__annotations__ if f"`{n}`" in GUIDE or f"`{n} =" in GUIDE]
    formless = [n for n in named if not re.search(rf"\b{n} = ", GUIDE)]
    assert "encoder_components" in named and not formless, formless


# ------------------------------------------------------------ 3. trained tensors by module name
def test_a_trained_module_is_found_by_its_name_and_a_missing_one_shows_close_names() -> None:
    from diffpipe_core.testing.runs import assert_holds

    params = {
        f"transformer_blocks.{i}.attn.{m}.lora_{ab}.weight": torch.zeros(1)
        for i in range(2)
        for m in ("to_q", "to_k")
        for ab in "AB"
    }
    assert_holds(params, ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.to_k.lora_B.weight"), "x")
    with pytest.raises(AssertionError, match=r"transformer_blocks\.0\.attn\.to_v .*closest: .*transformer_blocks\.0\."):
        assert_holds(params, ("transformer_blocks.0.attn.to_v",), "the checkpoint")


# ------------------------------------------------------------ 4. saved LoRAs are in save_dtype
def test_the_guide_says_saved_loras_are_in_save_dtype_with_its_default() -> None:
    """The default the guide gives is the schema's, and the shared test projects save in float32 as it says."""
    from diffpipe_core.config import RunConfig
    from diffpipe_core.testing.runs import run_toml

    default = RunConfig.model_fields["save_dtype"].default
    exports = GUIDE.split("### Exports")[1].split("\n### ")[0]
    assert f'**`save_dtype`** (a top-level run key, `"{default}"` by default)' in exports
    assert 'set `save_dtype = "float32"`' in exports
    import tomllib

    assert tomllib.loads(run_toml({"type": "x", "path": "m"}, {}))["save_dtype"] == "float32"
