"""What an outside author hit writing a plugin from the guide alone (Qwen-Image, issue 18, findings 1-6 and 9),
each fixed in the core and checked here.

Most checks run on the plugin ``diffpipe plugin new`` renders (on the shared parts), imported in-process with its
tiny model written to disk, so they also show that the template gets these things right by itself.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import safe_open
from torch import nn

import diffpipe_core
import diffpipe_reference.plugin as reference
from diffpipe_core import CONTRACT_VERSION, ModelSpec, hookimpl, hookspecs, types
from diffpipe_core.adapters import apply_lora, lora_config
from diffpipe_core.engine.model_loading import meta_tensors
from diffpipe_core.engine.saving import write_adapter
from diffpipe_core.parts.config import DiffusersModelConfig
from diffpipe_core.parts.flow import flow_loss
from diffpipe_core.parts.folder import DiffusersFolder
from diffpipe_core.parts.plugin import DiffusersModel
from diffpipe_core.plugin_cli import plugin as plugin_cli
from diffpipe_core.registry import PluginError, Registry
from diffpipe_core.scaffold import render_plugin
from diffpipe_core.testing import tiny
from diffpipe_core.testing.conformance import _check_nothing_on_meta, check_lora_gradients, check_model_plugin
from diffpipe_core.testing.imports import check_light_imports
from diffpipe_core.testing.processes import write_plugin_distribution
from diffpipe_reference.model import TinyDiT as ReferenceDiT
from diffpipe_reference.model import read_config, write_tiny_model

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "plugins" / "README.md").read_text()
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory):
    """The rendered template (model ``kit-check``), importable in this process, and its tiny model folder."""
    root = render_plugin("kit-check", tmp_path_factory.mktemp("rendered"))
    sys.path.insert(0, str(root / "src"))
    try:
        module = importlib.import_module("diffpipe_kit_check.plugin")
        folder = importlib.import_module("diffpipe_kit_check.testing").write_tiny_model(root / "tiny")
        cfg = module.plugin.spec.config_schema(type="kit-check", path=folder, dtype="float32", encoder_dtype="float32")
        yield module, cfg
    finally:
        sys.path.remove(str(root / "src"))


# ------------------------------------------------------------------------- 1. names with '-'
def test_plugin_new_takes_a_dashed_name_and_makes_the_package_name_from_it(tmp_path: Path) -> None:
    result = CliRunner().invoke(plugin_cli, ["new", "acme-image", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    pkg = tmp_path / "diffpipe-acme-image"
    assert 'acme-image = "diffpipe_acme_image.plugin:plugin"' in (pkg / "pyproject.toml").read_text()
    source = (pkg / "src" / "diffpipe_acme_image" / "plugin.py").read_text()
    assert 'name="acme-image"' in source and "class AcmeImage(DiffusersModel" in source
    assert (pkg / "tests" / "test_acme_image_plugin.py").is_file()
    for bad in ("qwen-", "qwen--image", "Qwen-Image", "1qwen"):
        refused = CliRunner().invoke(plugin_cli, ["new", bad, "--dir", str(tmp_path / "no")])
        assert refused.exit_code == 1 and f"{bad!r} is not valid" in refused.output, (bad, refused.output)
    assert not (tmp_path / "no").exists() or not any((tmp_path / "no").iterdir())


# ------------------------------------------------------------------------- 2. lora_targets
def adapted(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


def attn_tree() -> nn.Module:
    attn = nn.ModuleDict({"to_q": nn.Linear(4, 4), "add_to_q": nn.Linear(4, 4)})
    return nn.ModuleDict({"blocks": nn.ModuleList([nn.ModuleDict({"attn": attn})])})


def test_lora_targets_match_as_the_hookspec_and_the_guide_say() -> None:
    """Exact names or dotted suffixes (peft's rule for a list), not regexes."""
    doc = inspect.getdoc(hookspecs.lora_targets)
    assert "exact module names or dotted suffixes, not regexes" in doc and "regex suffixes" not in doc
    assert "exact module names or dotted suffixes" in GUIDE and "regex suffixes" not in GUIDE
    for targets in (["to_q"], ["attn.to_q"], ["blocks.0.attn.to_q"]):
        assert adapted(apply_lora(attn_tree(), lora_config(2, 2, 0.0, targets))) == {"blocks.0.attn.to_q"}, targets
    with pytest.raises(ValueError, match="matched nothing"):
        apply_lora(attn_tree(), lora_config(2, 2, 0.0, ["to_.*"]))


def kit_inputs(model: nn.Module) -> list:
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 4, model.config.text_dim, generator=g)
    return [((x, torch.rand(1, generator=g), text), (torch.randn(1, 4, 8, 8, generator=g),))]


def test_the_kit_names_a_lora_module_whose_output_nothing_reads(rendered) -> None:
    """Targeting the last joint block's text side (all suffixes, nothing left out) fails the kit, naming the modules
    and the cause; the template's default targets leave exactly those out, so the same check passes."""
    module, cfg = rendered
    plugin = module.plugin
    for targets, fails in ((list(plugin.lora_target_names), True), (plugin.lora_targets(cfg), False)):
        model = plugin.load_diffusion_model(cfg, torch.device("cpu"), torch.float32)
        layers = plugin.split_into_layers(model, cfg)
        if not fails:
            check_lora_gradients(model, layers, kit_inputs(model), targets, lambda t: lambda o: flow_loss(o, t))
            continue
        with pytest.raises(AssertionError) as err:
            check_lora_gradients(model, layers, kit_inputs(model), targets, lambda t: lambda o: flow_loss(o, t))
        for name in ("attn.add_q_proj", "attn.to_add_out", "ff_context.net.0.proj", "ff_context.net.2"):
            assert f"transformer_blocks.1.{name}'s output is used by no later layer" in str(err.value), name
        assert "last_block_unused" in str(err.value) and "transformer_blocks.0." not in str(err.value)


def test_default_targets_expand_only_what_they_leave_out(rendered) -> None:
    module, cfg = rendered
    plugin = module.plugin
    kept = [n for n in plugin.lora_target_names if n not in plugin.last_block_unused]
    full = [f"transformer_blocks.0.{n}" for n in plugin.lora_target_names if n in plugin.last_block_unused]
    assert sorted(plugin.lora_targets(cfg)) == sorted(kept + full)  # 2 blocks: only block 0 keeps them

    class Plain(type(plugin)):
        last_block_unused = ()

    assert Plain().lora_targets(cfg) == list(plugin.lora_target_names)  # nothing left out: the list as declared


# ------------------------------------------------------------------------- 3. alpha of the diffusers LoRA
def test_the_diffusers_lora_carries_alpha_in_its_metadata_as_documented(tmp_path: Path) -> None:
    doc = inspect.getdoc(hookspecs.export_adapter)
    assert "with ``.alpha`` tensors" not in doc and "lora_adapter_metadata" in doc
    assert "lora_adapter_metadata" in GUIDE
    registry = Registry()
    registry.register_model("reference", reference)
    state = {"blocks.0.attn.to_q.lora_A.weight": torch.ones(4, 8), "blocks.0.attn.to_q.lora_B.weight": torch.ones(8, 4)}
    write_adapter(tmp_path, state, registry.model("reference"), lora_config(4, 8, 0.0, ["to_q"]), [], torch.float32)
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if k.endswith(".alpha")]
        # trained with alpha 8 at rank 4: the strength 2 is in lora_B, the file says alpha = rank
        assert json.loads(f.metadata()["lora_adapter_metadata"])["transformer.lora_alpha"] == 4
        assert f.metadata()["diffpipe.trained_alpha"] == "8"
        assert torch.equal(f.get_tensor("transformer.blocks.0.attn.to_q.lora_B.weight"), torch.full((8, 4), 2.0))


# ------------------------------------------------------------------------- 4. plain tensor attributes
class RopeDiT(ModelMixin, ConfigMixin):
    """A model keeping a RoPE table as a plain attribute (like Qwen-Image's ``pos_embed.pos_freqs``) and a
    non-persistent buffer: no weight file holds either."""

    @register_to_config
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.freqs = torch.arange(dim, dtype=torch.float32) / dim
        self.register_buffer("scale", torch.full((dim,), 2.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x * self.freqs) * self.scale


class RopeModel(DiffusersModel):
    spec = ModelSpec(name="rope", modality="image", config_schema=DiffusersModelConfig)
    folder = DiffusersFolder("rope", ("RopePipeline",), {"transformer": f"{__name__}:RopeDiT"})
    model_class = f"{__name__}:RopeDiT"


def test_a_meta_skeleton_computes_what_no_weight_file_holds(tmp_path: Path) -> None:
    torch.manual_seed(0)
    RopeDiT().save_pretrained(str(tmp_path / "transformer"))
    cfg = DiffusersModelConfig(type="rope", path=tmp_path, dtype="float32")
    skeleton = RopeModel().build_skeleton(cfg, "meta", torch.float32)
    assert sorted(meta_tensors(skeleton)) == ["proj.bias", "proj.weight"]  # the weight files fill these
    assert torch.equal(skeleton.freqs, torch.arange(8) / 8) and torch.equal(skeleton.scale, torch.full((8,), 2.0))
    whole = RopeModel().load_diffusion_model(cfg, torch.device("cpu"), torch.float32)
    assert meta_tensors(whole) == [] and whole(torch.ones(1, 8)).isfinite().all()

    with torch.device("meta"):  # the old way: everything stays on meta, the kit names each tensor
        old = RopeDiT()
    with pytest.raises(
        AssertionError,
        match=r"4 tensors are still on the meta device: proj\.weight, proj\.bias, "
        r"scale, freqs\..*parameters_on_meta",
    ):
        _check_nothing_on_meta(old, "a meta build")


class RopeReference(ReferenceDiT):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.rope_table = torch.ones(config.dim)  # a plain attribute


@hookimpl
def load_on_meta(model_config, device, dtype):
    """The reference model with a plain-attribute table, built under ``torch.device("meta")``."""
    with torch.device("meta"):
        model = RopeReference(read_config(model_config.path))
    if device.type != "meta":
        model = model.to_empty(device=device)
        model.load_state_dict(reference.load_diffusion_model(model_config, device, dtype).state_dict())
    return model.to(dtype)


def meta_build_plugin() -> object:
    """The reference plugin's hooks, ``load_diffusion_model`` replaced by :func:`load_on_meta`."""
    hooks = {
        name: getattr(reference, name) for name in dir(reference) if hasattr(getattr(reference, name), "diffpipe_impl")
    }
    hooks["load_diffusion_model"] = load_on_meta
    return type("MetaBuildPlugin", (), {name: staticmethod(fn) for name, fn in hooks.items()})()


def test_the_kit_names_the_tensor_a_meta_build_left_behind(tmp_path: Path) -> None:
    """Named before anything uses it (a forward would fail with "Cannot copy out of meta tensor")."""
    write_tiny_model(tmp_path / "m")
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    with pytest.raises(AssertionError, match=r"still on the meta device: rope_table\. No weight file fills"):
        check_model_plugin(
            meta_build_plugin(), "reference", {"type": "reference", "path": tmp_path / "m"}, pixels, ["a", "b"]
        )


# ------------------------------------------------------------------------- 5. settings reach encode_batch
def test_encode_batch_settings_travel_in_encoders_config_as_documented(rendered) -> None:
    module, cfg = rendered
    for hook in (hookspecs.load_encoders, hookspecs.encode_batch):
        assert "encoders.config" in inspect.getdoc(hook), hook.__name__
    assert "encoders.config" in GUIDE
    encoders = module.plugin.load_encoders(cfg, torch.device("cpu"))
    assert encoders.config is cfg and encoders.config.text_max_length == 16


# ------------------------------------------------------------------------- 6. a BPE template prefix
def test_the_tiny_bpe_tokenizer_cuts_template_prefixes_as_the_real_ones_do() -> None:
    """Trained on the prompt template, the prefix gets the real tokenizer's token count: what the pipelines drop."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    from diffpipe_core.parts.text import text_pipeline

    qwen = text_pipeline("QwenImagePipeline")  # its template and drop count are set in __init__
    hunyuan = DEFAULT_PROMPT_TEMPLATE
    cases = [
        (
            qwen.prompt_template_encode,
            qwen.prompt_template_encode_start_idx,
            tiny.QWEN2_SPLIT,
            "$A",
            ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        ),
        (
            hunyuan["template"],
            hunyuan["crop_start"],
            tiny.LLAMA3_SPLIT,
            "<|begin_of_text|> $A",
            ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        ),
    ]
    assert [c[1] for c in cases] == [34, 95]
    for template, real_count, split, post, specials in cases:
        tok = tiny.bpe_tokenizer([template.replace("{}", " ".join(tiny.WORDS))], specials, post, 512, split=split)
        prefix = tok(template.split("{}")[0]).input_ids
        assert len(prefix) == real_count, (template[:30], len(prefix))
        full = tok(template.format("a red cat")).input_ids
        assert full[: len(prefix)] == prefix  # the caption starts right after the dropped tokens
        assert tok.decode(full[len(prefix) :], skip_special_tokens=True).startswith("a red cat")


def test_no_shipped_docstring_names_a_path_outside_the_repository() -> None:
    found = [str(p) for p in (ROOT / "diffpipe_core").rglob("*.py") if re.search(r"/work/|/home/|/tmp/", p.read_text())]
    assert not found, found


# ------------------------------------------------------------------------- 9. the contract's version
class FuturePlugin:
    @hookimpl
    def model_spec(self):
        return ModelSpec(
            name="future", modality="image", config_schema=DiffusersModelConfig, contract=CONTRACT_VERSION + 1
        )


def test_a_plugin_needing_a_newer_contract_is_refused_by_name() -> None:
    registry = Registry()
    info = registry.register_model("future", FuturePlugin())
    assert not info.ok and "needs plugin contract" in info.error
    with pytest.raises(PluginError) as err:
        registry.model("future")
    text = str(err.value)
    assert f"'future' needs plugin contract {CONTRACT_VERSION + 1}" in text
    assert f"implements contract {CONTRACT_VERSION}: upgrade diffpipe-core" in text


def test_a_plugin_importing_a_newer_cores_name_gets_the_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = write_plugin_distribution(
        tmp_path / "site",
        "diffpipe-future",
        {"diffpipe.models": {"future": "future_plugin"}},
        {"future_plugin": "from diffpipe_core.parts.plugin import DiffusersModelFromTheFuture\n"},
    )
    monkeypatch.syspath_prepend(str(site))
    registry = Registry()
    registry.load_entry_points()
    error = registry.plugins["future"].error
    assert "DiffusersModelFromTheFuture" in error and f"implements plugin contract {CONTRACT_VERSION}" in error


def test_the_changelog_covers_the_contract_and_the_template_declares_it(rendered) -> None:
    module, _ = rendered
    versions = [int(v) for v in re.findall(r"^## Contract (\d+)", CHANGELOG, re.M)]
    assert versions == list(range(CONTRACT_VERSION, 0, -1)), versions
    hooks = [name for name, fn in vars(hookspecs).items() if hasattr(fn, "diffpipe_spec")]
    fields = [
        f
        for cls in vars(types).values()
        if isinstance(cls, type) and cls.__module__ == types.__name__
        for f in (getattr(cls, "__dataclass_fields__", None) or getattr(cls, "model_fields", {}))
    ]
    named = set(re.findall(r"\w+", " ".join(re.findall(r"`([^`]*)`", CHANGELOG))))
    missing = [n for n in hooks + fields if n not in named]
    assert not missing, f"CHANGELOG.md names none of {missing}: say in which contract they came"
    assert module.plugin.spec.contract == CONTRACT_VERSION == diffpipe_core.CONTRACT_VERSION


# ----------------------------------------------------------- the kit checks fast start of a plugin instance
def test_the_kit_checks_fast_start_of_a_plugin_instance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The template's entry point names an instance (``plugin = MyModel()``); the kit must check it too."""
    (tmp_path / "heavy_instance.py").write_text(
        "import torch\nfrom diffpipe_core import hookimpl\n\n\nclass Heavy:\n    pass\n\n\nplugin = Heavy()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    heavy = importlib.import_module("heavy_instance")
    with pytest.raises(AssertionError, match=r"imports torch while importing the module.*heavy_instance:plugin"):
        check_light_imports(heavy.plugin, "")
