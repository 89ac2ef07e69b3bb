"""Issue 26 in the core, in-process: the [adapter] types' config checks, LoKr/LoHa saved and read back (load_adapter,
init_from_existing), per-component learning rates, and the ComfyUI layout's alpha for a LoKr whose factors are
whole. The ComfyUI-formula checks against real models are in the Flux and SDXL plugins' test_*_lokr.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftConfig
from safetensors.torch import load_file

from diffpipe_core.adapter_kinds import comfy_tensors, config_from_saved, peft_config, unfold_factor, with_strength
from diffpipe_core.adapters import (
    ADAPTER_FILE,
    adapter_state_dict,
    apply_adapter,
    diffusers_format,
    load_adapter,
    read_adapter,
    save_adapter,
)
from diffpipe_core.config import OptimizerConfig, load_config
from diffpipe_core.engine.saving import write_adapter
from diffpipe_core.engine.stage_build import init_adapter_from
from diffpipe_core.optim import build_optimizer, parameter_groups
from diffpipe_core.registry import get_registry
from diffpipe_core.schema import ConfigError
from diffpipe_core.testing.comfy import (
    apply_file,
    assert_applies_as_trained,
    delta_weight,
    merged_weights,
    transformer_names_key_map,
)
from diffpipe_core.testing.media import write_dataset_toml, write_image_dataset
from diffpipe_reference.model import TinyDiT, load_module, write_tiny_model

RUN = """
output_dir = "out"
dataset = "dataset.toml"

[model]
type = "reference"
path = "model"
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kinds")
    write_tiny_model(root / "model")
    write_image_dataset(root / "images", 2)
    write_dataset_toml(root / "dataset.toml", root / "images", resolutions=[64])
    return root


def problems(project: Path, tables: str, model: str = "") -> list[str]:
    (project / "run.toml").write_text(RUN + model + tables)
    with pytest.raises(ConfigError) as err:
        load_config(project / "run.toml", get_registry())
    return err.value.problems


def test_adapter_and_optimizer_keys_are_checked(project: Path) -> None:
    (project / "run.toml").write_text(
        RUN + '[adapter]\ntype = "lokr"\nrank = 4\nfactor = 8\n[optimizer]\ngroup_lr = { attention = 1e-5 }\n'
    )
    cfg = load_config(project / "run.toml", get_registry())
    assert cfg.run.adapter.type == "lokr" and cfg.run.adapter.factor == 8
    assert cfg.run.optimizer.group_lr == {"attention": 1e-5}
    [p] = problems(project, '[adapter]\ntype = "lokr"\ndropout = 0.1\n')
    assert "adapter.dropout applies to type = 'lora' only, not 'lokr'" in p and "run.toml" in p
    [p] = problems(project, "[adapter]\nfactor = 4\n")
    assert "adapter.factor applies to type = 'lokr' only" in p
    [p] = problems(project, '[adapter]\ntype = "lokr"\nfactor = 0\n')
    assert "0 is not a factor" in p
    [p] = problems(project, '[adapter]\ntype = "lokx"\n')
    assert "adapter.type" in p and "'lokr'" in p and "'loha'" in p
    [p] = problems(project, "[adapter]\n[optimizer]\ngroup_lr = { text_encoder = 1e-5 }\n")
    assert "optimizer.group_lr: model 'reference' has no parameter group 'text_encoder'" in p
    assert "its groups: 'mlp', 'attention'" in p
    [p] = problems(project, "[adapter]\n[optimizer]\ngroup_lr = { mlp = -1.0 }\n")
    assert "must be >= 0" in p
    [p] = problems(project, '[adapter]\ntype = "loha"\n', model='quantize = "nf4"\n')
    assert "model.quantize: 'nf4' works with type = 'lora' only" in p


def test_lokr_in_a_layout_the_plugin_names_no_keys_for_is_refused(project: Path, monkeypatch) -> None:
    # the reference plugin declares a 'comfyui' format for this check, but no adapter_key_names
    import dataclasses

    plugin = get_registry().model("reference")
    spec = dataclasses.replace(plugin.spec, adapter_formats=("diffusers", "comfyui"))
    monkeypatch.setattr(plugin.info, "spec", spec)
    [p] = problems(project, '[adapter]\ntype = "loha"\nsave_formats = ["diffusers", "comfyui"]\n')
    assert "saves a 'loha' adapter in the 'diffusers' layout only" in p and "remove ['comfyui']" in p


def reference_model(project: Path) -> TinyDiT:
    return load_module(TinyDiT, project / "model", "transformer", torch.device("cpu"), torch.float32)


def trained_adapter(project: Path, config: PeftConfig) -> torch.nn.Module:
    """The reference model with ``config``'s adapter, every factor drawn from ``normal(0, 1)`` (seed 0)."""
    model = apply_adapter(reference_model(project), config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_()
    return model


def assert_same_weights(got: torch.nn.Module, expected: torch.nn.Module) -> None:
    want, have = merged_weights(expected), merged_weights(got)
    assert all(torch.allclose(have[k], want[k], rtol=1e-6, atol=1e-6) for k in want)


@pytest.mark.parametrize("kind", ["lora", "lokr", "loha"])
def test_saved_adapter_loads_back_and_starts_a_run(project: Path, tmp_path: Path, kind: str) -> None:
    plugin = get_registry().model("reference")
    options = {"factor": 4} if kind == "lokr" else {}
    config = peft_config(kind, 2, 4.0, ["to_q", "fc1"], **options)
    model = trained_adapter(project, config)
    assert write_adapter(tmp_path / "saved", adapter_state_dict(model), plugin, config, [], torch.float32) == []
    state, saved = read_adapter(tmp_path / "saved")
    # the trained alpha 4 is folded into the tensors: alpha = rank, so every tool applies the trained strength
    assert saved["peft_type"] == kind.upper() and saved["lora_alpha" if kind == "lora" else "alpha"] == 2.0
    assert config_from_saved(saved).to_dict() == with_strength(config, 2.0).to_dict()
    # load_adapter (diffpipe sample --adapter) and init_from_existing (a new run, alpha 4 again) reproduce the weights
    fresh = apply_adapter(reference_model(project), config)
    init_adapter_from(fresh, plugin, tmp_path / "saved", config)
    for other in (load_adapter(reference_model(project), tmp_path / "saved"), fresh):
        assert_same_weights(other, model)
    other = "lokr" if kind == "lora" else "lora"
    other_kind = peft_config(other, 2, 4.0, ["to_q"])
    with pytest.raises(ValueError, match=f"holds a {kind.upper()} adapter; this run trains type = '{other}'"):
        init_adapter_from(apply_adapter(reference_model(project), other_kind), plugin, tmp_path / "saved", other_kind)
    bigger = peft_config(kind, 3, 4.0, ["to_q", "fc1"], **options)
    with pytest.raises(ValueError, match="the rank, factor or target modules differ"):
        init_adapter_from(apply_adapter(reference_model(project), bigger), plugin, tmp_path / "saved", bigger)


@pytest.mark.parametrize("kind", ["lora", "lokr", "loha"])
def test_every_saved_layout_applies_the_trained_strength_whatever_alpha_the_tool_reads(
    project: Path, tmp_path: Path, kind: str
) -> None:
    """Trained with alpha 4 at rank 2 (strength 2), saved: the diffusers file applied as ComfyUI applies a file
    without ``.alpha`` (scale 1, ComfyUI's ``transformer.<module>`` key map) gives the trained weights."""
    plugin = get_registry().model("reference")
    config = peft_config(kind, 2, 4.0, ["to_q", "fc1"], **({"factor": 4} if kind == "lokr" else {}))
    model = trained_adapter(project, config)
    assert write_adapter(tmp_path / "s", adapter_state_dict(model), plugin, config, [], torch.float32) == []
    base = merged_weights(reference_model(project))
    file = load_file(str(tmp_path / "s" / ADAPTER_FILE))
    assert not [k for k in file if k.endswith(".alpha")]
    applied = apply_file(base, file, transformer_names_key_map(base, prefix=""))
    assert_applies_as_trained(applied, merged_weights(model), base)


def test_a_file_saved_before_the_fold_starts_a_run_at_its_own_strength(project: Path, tmp_path: Path) -> None:
    """A LoRA file written with alpha 4 at rank 2 and unfolded tensors (before diffpipe folded alpha in) started
    under alpha 2 gets its tensors rescaled, so the run starts from the saved adapter's weights."""
    plugin = get_registry().model("reference")
    config = peft_config("lora", 2, 4.0, ["to_q", "fc1"])
    model = trained_adapter(project, config)
    files = {ADAPTER_FILE: diffusers_format(adapter_state_dict(model), "transformer")}
    save_adapter(tmp_path / "old", files, config, torch.float32, "transformer")
    assert read_adapter(tmp_path / "old")[1]["lora_alpha"] == 4.0
    weaker = peft_config("lora", 2, 2.0, ["to_q", "fc1"])
    fresh = apply_adapter(reference_model(project), weaker)
    init_adapter_from(fresh, plugin, tmp_path / "old", weaker)
    assert_same_weights(fresh, model)
    assert unfold_factor(config, weaker) == 2.0 and unfold_factor(with_strength(config, 2.0), config) == 0.5


def test_lokr_with_whole_factors_gets_its_strength_in_comfyui_layout() -> None:
    """ComfyUI scales a LoKr by alpha / rank only when a factor is decomposed; with both factors whole it applies
    kron(w1, w2) as is, so peft's alpha / r must be inside the saved w1."""
    linear = torch.nn.Linear(16, 16, bias=False)
    config = peft_config("lokr", 8, 2.0, ["0"])  # rank 8 >= half of each 4 x 4 factor: both whole
    model = apply_adapter(torch.nn.Sequential(linear), config)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_()
    state = adapter_state_dict(model)
    assert set(state) == {"0.lokr_w1", "0.lokr_w2"}
    [tensors] = comfy_tensors(state, config).values()
    peft_delta = model[0].get_delta_weight("default")
    assert torch.allclose(delta_weight(tensors, (16, 16)), peft_delta, atol=1e-6)
    unscaled = {**tensors, "lokr_w1": state["0.lokr_w1"]}
    assert not torch.allclose(delta_weight(unscaled, (16, 16)), peft_delta, atol=1e-3)  # the fold is needed


def test_group_lr_makes_one_optimizer_group_per_component(project: Path) -> None:
    model = apply_adapter(reference_model(project), peft_config("lora", 2, 2.0, ["to_q", "fc1"]))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    named = get_registry().model("reference").call("parameter_groups", model_config=None)
    cfg = OptimizerConfig(lr=1e-3, group_lr={"attention": 0.0})
    groups = parameter_groups(cfg, trainable, named)
    half = len(trainable) // 2  # to_q and fc1 of every block: one LoRA each
    assert [(g["name"], g["lr"], len(g["params"])) for g in groups] == [("mlp", 1e-3, half), ("attention", 0.0, half)]
    attention = {id(p) for p in groups[1]["params"]}
    assert attention == {id(p) for n, p in trainable.items() if ".attn.to_q." in n}
    optimizer = build_optimizer(cfg, groups, get_registry().pm)
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 0.0]
    before = {n: p.detach().clone() for n, p in trainable.items()}
    for p in trainable.values():
        p.grad = torch.ones_like(p)
    optimizer.step()
    for n, p in trainable.items():
        assert torch.equal(p, before[n]) == (".attn." in n), n  # lr 0 freezes the attention group only
    # without group_lr: one group, laid out as before groups existed
    [one] = parameter_groups(OptimizerConfig(lr=1e-3), trainable, named)
    assert one["name"] == "model" and len(one["params"]) == len(trainable)
