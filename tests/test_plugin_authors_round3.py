"""What an outside author hit writing a Stable Diffusion 3.5 plugin from the guide, the template and the kit
(issue 36), each fixed and checked here.

The kit's sample comparison runs on ``tests/fixtures/diffpipe-acme-auraflow``: the template rendered (as an outside
author would name it, ``acme-auraflow``) for ``AuraFlowPipeline`` with only its declarations filled in and its layers
written for diffusers' ``AuraFlowTransformer2DModel``; its own tests (the rendered ones) pass the kit. (diffpipe's own
AuraFlow plugin, ``plugins/diffpipe_auraflow``, grew from it.)
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
FIXTURE = ROOT / "tests" / "fixtures" / "diffpipe-acme-auraflow"
GUIDE = (ROOT / "plugins" / "README.md").read_text()
CAPTIONS = ["a red cat", "a blue dog"]


@pytest.fixture(scope="module")
def auraflow(tmp_path_factory: pytest.TempPathFactory):
    """The rendered AuraFlow plugin (imported from the fixture's ``src``) and its tiny model folder."""
    sys.path.insert(0, str(FIXTURE / "src"))
    try:
        from diffpipe_acme_auraflow.plugin import plugin
        from diffpipe_acme_auraflow.testing import write_tiny_model

        yield plugin, write_tiny_model(tmp_path_factory.mktemp("auraflow") / "model")
    finally:
        sys.path.remove(str(FIXTURE / "src"))


def _kit(plugin, folder: Path) -> None:
    pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    check_model_plugin(plugin, "acme-auraflow", {"type": "acme-auraflow", "path": str(folder)}, pixels, CAPTIONS)


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


def test_a_pipeline_the_kit_cannot_run_is_named_with_the_arguments(auraflow, tmp_path: Path) -> None:
    from diffpipe_core.testing.sampling import pipeline_sample
    from diffpipe_core.types import SampleRequest

    _, folder = auraflow
    noise, request = torch.zeros(1, 4, 4, 4), SampleRequest(width=32, height=32, steps=3)
    with pytest.raises(AssertionError, match=r"'AuraFlowPipeline' failed on the tiny model .*max_sequence_lenght.*"
                       r"TypeError.*sample_pipeline_settings"):  # fmt: skip
        pipeline_sample("AuraFlowPipeline", folder, ("a", "b"), noise, request, {"max_sequence_lenght": 16})
    with pytest.raises(AssertionError, match=r"'AuraFlowPipeline' does not load the tiny model folder"):
        pipeline_sample("AuraFlowPipeline", tmp_path, ("a", "b"), noise, request, {})
    with pytest.raises(AssertionError, match=r"'AuraFlowPipe' is not a diffusers pipeline class"):
        pipeline_sample("AuraFlowPipe", folder, ("a", "b"), noise, request, {})


def test_the_fixture_is_the_template_with_declarations_filled_in(tmp_path: Path) -> None:
    """Against a fresh rendering: every hook body of plugin.py is the template's (only the declarations above the
    hooks differ), config.py is unchanged, model.py is gone (a diffusers class is named), and the plugin with its
    schema is at most 150 lines."""
    fresh = render_plugin("acme-auraflow", tmp_path) / "src" / "diffpipe_acme_auraflow"
    ours = FIXTURE / "src" / "diffpipe_acme_auraflow"
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


# ------------------------------------------------------------ 6. two plugins with the same names
def _plugin_source(name: str) -> str:
    return f"""
from diffpipe_core import ModelConfigBase, ModelSpec, hookimpl

class Config(ModelConfigBase):
    pass

@hookimpl
def model_spec():
    return ModelSpec(name={name!r}, modality="image", config_schema=Config)
"""


def test_plugins_clashing_over_a_name_are_named_in_one_line_each_and_the_others_work(tmp_path: Path) -> None:
    """Installed beside the bundled plugins: a plugin published as ``diffpipe-wan`` (pip replaces diffpipe's, and
    ``wan-i2v`` would vanish), one declaring model ``flux`` again, and one installing its files into the package
    ``diffpipe_zimage``. ``diffpipe models`` says each in one line naming the distributions and the name; flux stays
    diffpipe's, z-image's failure names the package's two owners, and every other model loads."""
    from diffpipe_core.testing.processes import cli_env, run_diffpipe, write_plugin_distribution

    site = tmp_path / "site"
    write_plugin_distribution(
        site, "diffpipe-wan", {"diffpipe.models": {"wan": "my_wan"}}, {"my_wan": _plugin_source("wan")}
    )
    write_plugin_distribution(
        site, "diffpipe-fastflux", {"diffpipe.models": {"flux": "fast_flux"}}, {"fast_flux": _plugin_source("flux")}
    )
    write_plugin_distribution(
        site,
        "diffpipe-zimage-turbo",
        {"diffpipe.models": {"zimage-turbo": "diffpipe_zimage.turbo"}},
        {"diffpipe_zimage.turbo": _plugin_source("zimage-turbo")},
    )
    result = run_diffpipe(["models"], cwd=tmp_path, timeout=120, env=cli_env([site]))
    assert result.returncode == 0, result.output
    said = [line for line in result.stderr.splitlines() if line.startswith("diffpipe: ")]
    assert len(said) == 3, result.stderr
    replaced, same_model, package = (
        next(line for line in said if key in line)
        for key in ("replaced", "model 'flux'", "package diffpipe_zimage")
    )
    missing = replaced.split("diffpipe-wan 0.0.1 provides wan but not ", 1)[-1].split(", which", 1)[0].split(", ")
    assert "wan-i2v" in missing and "skyreels-v2" in missing and "distribution diffpipe-<org>" in replaced, replaced
    assert "diffpipe-fastflux 0.0.1 and diffpipe-flux 0.1.0" in same_model and "using diffpipe-flux's" in same_model
    assert "diffpipe-zimage and diffpipe-zimage-turbo" in package and "package diffpipe_<org>_<model>" in package
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert "diffpipe-flux" in rows["flux"] and rows["flux"].rstrip().endswith("ok")
    assert "FAILED" in rows["z-image"] and "installed by diffpipe-zimage and diffpipe-zimage-turbo" in rows["z-image"]
    assert all(rows[m].rstrip().endswith("ok") for m in ("wan", "zimage-turbo", "sdxl", "reference", "qwen-image"))
    assert "wan-i2v" not in rows
    other = run_diffpipe(["validate", "--config", "run.toml"], cwd=tmp_path, timeout=120, env=cli_env([site]))
    assert [line for line in other.stderr.splitlines() if line in said] == said, other.stderr  # every command


def test_a_model_name_two_outside_plugins_declare_is_loaded_from_neither(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither distribution is diffpipe's: which would win is undefined, so neither loads, and asking for the model
    says why; the registry records the line and the other models load."""
    from diffpipe_core.registry import PluginError, Registry
    from diffpipe_core.testing.processes import write_plugin_distribution

    site = tmp_path / "site"
    for dist, module in (("diffpipe-acme-dup", "acme_dup"), ("diffpipe-other-dup", "other_dup")):
        write_plugin_distribution(site, dist, {"diffpipe.models": {"dup": module}}, {module: _plugin_source("dup")})
    monkeypatch.syspath_prepend(str(site))
    registry = Registry()
    registry.load_entry_points()
    (line,) = [c for c in registry.clashes if "'dup'" in c]
    assert "diffpipe-acme-dup 0.0.1 and diffpipe-other-dup 0.0.1" in line and "neither is loaded" in line
    with pytest.raises(PluginError, match="neither is loaded"):
        registry.model("dup")
    assert registry.plugins["reference"].ok


def test_the_guide_says_how_to_name_a_third_party_plugin() -> None:
    from diffpipe_core.plugin_clashes import NAMING

    naming = GUIDE.split("## Naming a third-party plugin")[1].split("\n## ")[0]
    for name in ("diffpipe-<org>-<model>", "diffpipe_<org>_<model>", "<org>-<model>"):
        assert name in naming and name in NAMING


def test_plugin_new_refuses_a_name_diffpipe_ships(tmp_path: Path) -> None:
    """``wan`` (a bundled model) and ``qwenimage`` (it would be the bundled distribution diffpipe-qwenimage) are
    refused before anything is written, with the naming rule."""
    from click.testing import CliRunner

    from diffpipe_core.plugin_cli import plugin as plugin_cli

    for name, owner in (("wan", "diffpipe-wan"), ("wan-i2v", "diffpipe-wan"), ("qwenimage", "diffpipe-qwenimage")):
        refused = CliRunner().invoke(plugin_cli, ["new", name, "--dir", str(tmp_path)])
        assert refused.exit_code == 1, refused.output
        assert f"model name {name!r} is diffpipe's own ({owner} ships it)" in refused.output
        assert f"e.g. acme-{name}" in refused.output
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------ 7. contract migrations
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()


def _contract_section(n: int) -> str:
    return CHANGELOG.split(f"\n## Contract {n} ")[1].split("\n## ")[0]


def test_every_kit_rule_a_contract_added_is_named_in_that_contracts_migration() -> None:
    from diffpipe_core.testing.contract_changes import RULES

    for rule, contract in RULES.items():
        must = " ".join(_contract_section(contract).split("Must change")[1].split())
        assert f"kit rule `{rule}`" in must, f"CHANGELOG Contract {contract}, Must change, does not name {rule}"


def test_every_migration_line_shows_the_exact_new_call() -> None:
    """Each bullet of a "Must change" list holds a code span with a call or an assignment: what to write."""
    import re

    for section in re.split(r"\n## Contract ", CHANGELOG)[1:]:
        if "Must change" not in section:
            continue
        must = section.split("Must change")[1]
        bullets = re.findall(r"^- (.+?)(?=^- |\Z)", must, re.S | re.M)
        for bullet in bullets:
            spans = re.findall(r"`([^`]+)`", bullet.replace("\n", " "))
            assert any("(" in s or " = " in s for s in spans), f"no exact call in: {bullet[:120]}"


def test_a_kit_failure_from_a_contract_change_names_the_changelog_entry() -> None:
    """The check an outside Wan plugin written against contract 2 hit without a word in the CHANGELOG: 4-D pixels for
    a video model. The failure names its rule and the entry, and the entry shows the call."""
    from diffpipe_core import ModelConfigBase, ModelSpec
    from diffpipe_core.testing.conformance import _media_batches

    spec = ModelSpec(name="old-wan", modality="video", config_schema=ModelConfigBase, frame_multiple=4, frame_offset=1)
    with pytest.raises(AssertionError) as failed:
        _media_batches(spec, torch.zeros(2, 3, 32, 32), torch.Generator())
    assert "kit rule `video_pixels`, new in plugin contract 2: CHANGELOG.md, 'Contract 2', Must change" in str(
        failed.value
    )
    entry = _contract_section(2).split("kit rule `video_pixels`")[1].split("\n- ")[0]
    assert "check_model_plugin(plugin, name, table," in entry and "pixels=torch.rand(2, 3, 5, 32, 32)" in entry
    assert "cast_skeleton(model, dtype)" in _contract_section(2)
