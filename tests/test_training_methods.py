"""Issue 42, the weights half: EMA, merge_adapters, CFG-augmented training, exclude_modules and name-pattern learning
rates. In-process checks of each method's formula on the reference model (real peft, real safetensors files, the
plugin's own hooks); the training runs are in test_training_methods_run.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from diffpipe_core.adapter_kinds import from_adapter_table
from diffpipe_core.adapters import apply_adapter, excluding
from diffpipe_core.config import AdapterConfig, EmaConfig, OptimizerConfig, load_config
from diffpipe_core.engine.cfg_training import fold_uncond
from diffpipe_core.engine.ema import EmaWeights
from diffpipe_core.engine.stage_build import LossFunction
from diffpipe_core.merge_adapters import merge_into, plan_updates
from diffpipe_core.optim import parameter_groups, unmatched_lr_patterns
from diffpipe_core.registry import get_registry
from diffpipe_core.schema import ConfigError
from diffpipe_core.types import MergedAdapter, TrainingContext
from diffpipe_reference.model import TinyDiT, TinyDiTConfig

TARGETS = ["to_q", "to_k", "to_v", "to_out", "fc1", "fc2"]


def tiny() -> TinyDiT:
    torch.manual_seed(0)
    return TinyDiT(TinyDiTConfig(depth=2))


# ------------------------------------------------------------------------------------------ EMA
def test_ema_follows_its_formula_and_swaps_in_and_back() -> None:
    """Copies up to start_step, then every every_n_steps-th step ema = decay * ema + (1 - decay) * w; a swap puts
    the average in the model and the weights back after; on the CPU the average never touches the weights'
    tensors."""
    w = torch.nn.Parameter(torch.zeros(3))
    cfg = EmaConfig(decay=0.9, start_step=2, every_n_steps=2, device="cpu")
    ema = EmaWeights(cfg, {"w": w})
    expected = torch.zeros(3)
    for step in range(1, 9):
        with torch.no_grad():
            w.add_(1.0)
        ema.update(step)
        if step <= 2:
            expected = w.detach().clone()
        elif (step - 2) % 2 == 0:
            expected = 0.9 * expected + 0.1 * w.detach()
        assert torch.allclose(ema.average["w"], expected), (step, ema.average["w"], expected)
    assert [s for s in range(1, 9) if ema.due(s)] == [4, 6, 8]
    weights, average = w.detach().clone(), ema.average["w"].clone()
    with ema.swapped_in():
        assert torch.equal(w.detach(), average)
    assert torch.equal(w.detach(), weights) and torch.equal(ema.average["w"], average)
    with ema.swapped_in(active=False):
        assert torch.equal(w.detach(), weights)
    saved = ema.checkpoint_tensors()
    assert list(saved) == ["ema/w"]
    fresh = EmaWeights(cfg, {"w": w})
    assert fresh.load(saved) and torch.equal(fresh.average["w"], average)
    assert not EmaWeights(cfg, {"w": w}).load({})  # a checkpoint without EMA: the average restarts from w


@pytest.mark.parametrize("use_for_samples", [True, False])
def test_samples_and_eval_use_the_ema_when_asked(use_for_samples: bool) -> None:
    """The trainer's sampling weights (what samples and eval losses run with) are the EMA with use_for_samples,
    the weights otherwise, and the weights again after."""
    from types import SimpleNamespace

    from diffpipe_core.engine.trainer import Trainer

    w = torch.nn.Parameter(torch.ones(2))
    cfg = EmaConfig(use_for_samples=use_for_samples)
    ema = EmaWeights(cfg, {"w": w})
    ema.average["w"].fill_(5.0)
    trainer = SimpleNamespace(stage=SimpleNamespace(ema=ema, optimizer=torch.optim.SGD([w], lr=0.1)),
                              run=SimpleNamespace(ema=cfg))
    with Trainer._sampling_weights(trainer):
        assert torch.equal(w.detach(), torch.full((2,), 5.0 if use_for_samples else 1.0))
    assert torch.equal(w.detach(), torch.ones(2))


# ------------------------------------------------------------------------------------------ CFG
def test_cfg_folds_the_gradient_free_uncond_prediction_into_the_loss() -> None:
    """The reference plugin's own compute_loss, through the stage's LossFunction with the step's unconditional
    outputs: the loss is that of (out + (N - 1) u) / N against the target, and the gradient reaches the weights
    through the conditional pass only (u, computed by the same model with gradients on, contributes none)."""
    plugin = get_registry().model("reference")
    config = plugin.spec.config_schema(type="reference", path=Path("unused"), cfg=3.0)
    model = tiny()
    x, t, text = torch.randn(2, 4, 8, 8), torch.rand(2), torch.randn(2, 16, 32)
    target = torch.randn(2, 4, 8, 8)
    loss_fn = LossFunction(plugin, TrainingContext(model_config=config))

    out = model(x, t, text)
    uncond = model(x, t, torch.zeros_like(text))  # with a graph: the fold must cut it
    loss_fn.uncond = [(uncond,)]  # the last layer's outputs are a tuple, as the pipeline passes them
    loss = loss_fn((out,), (target,))
    assert loss_fn.uncond == []  # consumed, one per micro-batch
    expected = ((out + 2.0 * uncond) / 3.0 - target).pow(2).mean()
    assert torch.allclose(loss, expected)
    grads = torch.autograd.grad(loss, list(model.parameters()))

    out2 = model(x, t, text)
    u = model(x, t, torch.zeros_like(text)).detach()
    by_hand = torch.autograd.grad(((out2 + 2.0 * u) / 3.0 - target).pow(2).mean(), list(model.parameters()))
    for got, want in zip(grads, by_hand, strict=True):
        assert torch.allclose(got, want, atol=1e-6)
    # and the uncond pass really would have had a gradient: cutting it is what makes these equal
    out3, u3 = model(x, t, text), model(x, t, torch.zeros_like(text))
    with_u = torch.autograd.grad(((out3 + 2.0 * u3) / 3.0 - target).pow(2).mean(), list(model.parameters()))
    assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(with_u, by_hand, strict=True))
    # without uncond outputs (cfg off, or eval) the loss is the plain one
    assert torch.allclose(loss_fn((out,), (target,)), (out - target).pow(2).mean())


def test_fold_keeps_structure_and_integer_outputs() -> None:
    out = (torch.ones(2, requires_grad=True), torch.tensor([1, 2]))
    folded = fold_uncond(out, [torch.full((2,), 4.0), torch.tensor([7, 7])], 2.0)
    assert isinstance(folded, tuple) and torch.equal(folded[1], out[1])
    assert torch.allclose(folded[0], torch.full((2,), 2.5))


# ------------------------------------------------------------------------------------------ merge_adapters
def lora_tensors(model: TinyDiT, modules: list[str], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Random LoRA A/B for ``modules`` of ``model`` (peft's names, without a prefix)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in modules:
        weight = model.get_submodule(name).weight
        out[f"{name}.lora_A.weight"] = torch.randn(rank, weight.shape[1], generator=gen) * 0.1
        out[f"{name}.lora_B.weight"] = torch.randn(weight.shape[0], rank, generator=gen) * 0.1
    return out


def test_merged_base_is_base_plus_the_weighted_deltas(tmp_path: Path) -> None:
    """A diffusers-layout file (keys under transformer., alpha in diffusers' metadata), a kohya one (lora_unet_,
    lora_down/up, per-module .alpha) and a peft folder (bare keys, adapter_config.json): each module's weight is
    base + weight * alpha / rank * B @ A, summed over the files; every other tensor is untouched."""
    base = tiny()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    a = lora_tensors(base, ["blocks.0.attn.to_q", "blocks.1.fc1"], rank=4, seed=1)
    b = lora_tensors(base, ["blocks.0.attn.to_q", "proj_out"], rank=2, seed=2)
    c = lora_tensors(base, ["blocks.1.attn.to_v"], rank=2, seed=3)
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": 4, "transformer.lora_alpha": 8.0}), "format": "pt"}
    save_file({f"transformer.{k}": v for k, v in a.items()}, str(tmp_path / "diffusers.safetensors"), meta)
    kohya = {}
    for key, value in b.items():
        module, _, rest = key.partition(".lora_")
        stem = "lora_unet_" + module.replace(".", "_")
        kohya[f"{stem}.lora_{'down' if rest.startswith('A') else 'up'}.weight"] = value
        kohya[f"{stem}.alpha"] = torch.tensor(1.0)
    save_file(kohya, str(tmp_path / "kohya.safetensors"))
    (tmp_path / "peft").mkdir()
    save_file(c, str(tmp_path / "peft" / "adapter_model.safetensors"))
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 6.0}))

    entries = [MergedAdapter(path=tmp_path / "diffusers.safetensors", weight=0.5),
               MergedAdapter(path=tmp_path / "kohya.safetensors", weight=1.0),
               MergedAdapter(path=tmp_path / "peft", weight=2.0)]
    assert merge_into(base, entries, "transformer") == 5
    expected = dict(before)

    def add(tensors: dict[str, torch.Tensor], scale: float) -> None:
        for key in tensors:
            if ".lora_A." in key:
                module = key.split(".lora_A.")[0]
                delta = tensors[key.replace("lora_A", "lora_B")] @ tensors[key]
                expected[f"{module}.weight"] = expected[f"{module}.weight"] + scale * delta

    add(a, 0.5 * 8.0 / 4)
    add(b, 1.0 * 1.0 / 2)
    add(c, 2.0 * 6.0 / 2)
    after = base.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == {"blocks.0.attn.to_q.weight", "blocks.1.fc1.weight", "proj_out.weight",
                       "blocks.1.attn.to_v.weight"}
    for key in after:
        assert torch.allclose(after[key], expected[key], atol=1e-6), key


def test_merge_refuses_a_file_that_is_no_lora_of_this_model(tmp_path: Path) -> None:
    model = tiny()
    names = [n for n, _ in model.named_modules()]
    save_file({"transformer.double_blocks.0.qkv.lora_A.weight": torch.zeros(2, 4),
               "transformer.double_blocks.0.qkv.lora_B.weight": torch.zeros(4, 2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match=r"other.safetensors: 'transformer.double_blocks.0.qkv.lora_A.weight' names"):
        plan_updates(tmp_path / "other.safetensors", names, "transformer")
    save_file({"transformer.blocks.0.attn.to_q.lokr_w1": torch.zeros(2, 2)}, str(tmp_path / "lokr.safetensors"))
    with pytest.raises(ValueError, match="only LoRAs merge"):
        plan_updates(tmp_path / "lokr.safetensors", names, "transformer")


# ------------------------------------------------------------------------------------------ exclude_modules
def test_exclude_modules_takes_out_exactly_the_matching_modules() -> None:
    model = tiny()
    adapter = AdapterConfig(exclude_modules=[r"^blocks\.0\.", "fc2"])
    config = excluding(model, from_adapter_table(adapter, TARGETS), adapter.exclude_modules)
    apply_adapter(model, config)
    adapted = sorted({n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad})
    assert adapted == ["blocks.1.attn.to_k", "blocks.1.attn.to_out", "blocks.1.attn.to_q", "blocks.1.attn.to_v",
                       "blocks.1.fc1"]
    with pytest.raises(ValueError, match=r"adapter.exclude_modules: 'norm_out' matches none of the 12 adapted"):
        excluding(tiny(), from_adapter_table(adapter, TARGETS), ["norm_out"])


# ------------------------------------------------------------------------------------------ group_lr patterns
def test_name_pattern_learning_rates_reach_their_parameter_groups() -> None:
    """``"*.attn.*"`` takes the attention LoRA tensors (before the plugin's named ``attention`` group would), the
    named ``mlp`` group keeps its lr for the rest; a pattern that matches nothing is named."""
    model = tiny()
    apply_adapter(model, from_adapter_table(AdapterConfig(), TARGETS))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    named = get_registry().model("reference").call("parameter_groups", model_config=None)
    cfg = OptimizerConfig(lr=1e-3, group_lr={"*.attn.*": 1e-4, "mlp": 5e-4, "*.fc2.*": 2e-4})
    groups = {g["name"]: g for g in parameter_groups(cfg, trainable, named)}
    assert set(groups) == {"mlp", "*.attn.*", "*.fc2.*"}
    by_id = {id(p): n for n, p in trainable.items()}
    assert {by_id[id(p)] for p in groups["*.attn.*"]["params"]} == {n for n in trainable if ".attn." in n}
    assert {by_id[id(p)] for p in groups["*.fc2.*"]["params"]} == {n for n in trainable if ".fc2." in n}
    assert {by_id[id(p)] for p in groups["mlp"]["params"]} == {n for n in trainable if ".fc1." in n}
    assert (groups["*.attn.*"]["lr"], groups["mlp"]["lr"], groups["*.fc2.*"]["lr"]) == (1e-4, 5e-4, 2e-4)
    assert unmatched_lr_patterns({"*.attn.*": 1.0, "*.ff.*": 1.0, "mlp": 1.0}, trainable) == ["*.ff.*"]


def test_a_group_at_learning_rate_zero_is_frozen() -> None:
    """``group_lr`` 0 freezes its group for real (no gradient, no optimizer state, out of the clipping norm); the other
    groups and a run without a zero rate keep every parameter trainable."""
    from diffpipe_core.optim import freeze_zero_lr_groups

    named = get_registry().model("reference").call("parameter_groups", model_config=None)
    model = tiny()
    assert freeze_zero_lr_groups(model, OptimizerConfig(group_lr={"mlp": 1e-4}), named) == []
    frozen = freeze_zero_lr_groups(model, OptimizerConfig(group_lr={"*.fc2.*": 0.0}), named)
    assert frozen and all(".fc2." in n for n in frozen) and len(frozen) == sum(".fc2." in n for n, _ in
                                                                              model.named_parameters())
    assert all(p.requires_grad == (".fc2." not in n) for n, p in model.named_parameters())


def test_a_modular_pipeline_folder_is_a_diffusers_folder(tmp_path: Path) -> None:
    """``modular_model_index.json`` (``ModularPipeline.save_pretrained``) names the pipeline where the folder has no
    ``model_index.json``; ``model_index.json`` wins where both are there."""
    from diffpipe_core.model_files import check_diffusers_folder, pipeline_index

    (tmp_path / "modular_model_index.json").write_text(json.dumps({"_class_name": "AnimaModularPipeline"}))
    assert pipeline_index(tmp_path).name == "modular_model_index.json"
    assert check_diffusers_folder(tmp_path, ("AnimaModularPipeline",), {}, "anima") == []
    [problem] = check_diffusers_folder(tmp_path, ("FluxPipeline",), {}, "flux")
    assert "modular_model_index.json: the pipeline is 'AnimaModularPipeline'" in problem
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    assert check_diffusers_folder(tmp_path, ("FluxPipeline",), {}, "flux") == []


# ------------------------------------------------------------------------------------------ bad values
@pytest.mark.parametrize(
    ("snippet", "message"),
    [
        ("[ema]\ndecay = 1.5\n", "ema.decay: invalid value 1.5"),
        ("[ema]\ndevice = 'gpu'\n", "ema.device: invalid value 'gpu'"),
        ("[ema]\nevery_n_steps = 0\n", "ema.every_n_steps: invalid value 0"),
        ("[adapter]\nexclude_modules = ['(']\n", "adapter.exclude_modules: '(' is not a regex"),
        ("[optimizer]\ngroup_lr = { attn = 1e-4 }\n", "has no parameter group 'attn'"),
        ("[model]\ncfg = 0.5\n", "model.cfg: invalid value 0.5"),
        ("[model]\nmerge_adapters = [{ path = 'missing.safetensors' }]\n", "model.merge_adapters[0].path: path not"),
        ("[model]\nmerge_adapters = [{ file = 'x' }]\n", "model.merge_adapters[0].file: unknown key"),
    ],
)
def test_bad_values_are_refused_naming_the_key(tmp_path: Path, snippet: str, message: str) -> None:
    table, _, body = snippet.partition("\n")
    tables = {"[model]": "type = 'reference'\npath = '.'\n", "[adapter]": "", "[optimizer]": ""}
    tables[table] = tables.get(table, "") + body
    text = "output_dir = 'out'\n" + "".join(f"{name}\n{rest}\n" for name, rest in tables.items())
    (tmp_path / "run.toml").write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "run.toml", get_registry(), purpose="sample")
    assert message in str(err.value), str(err.value)


# ------------------------------------------------------------------------------------------ the anchor's part lrs
def test_the_anchors_block_part_learning_rates_become_name_patterns(tmp_path: Path) -> None:
    """diffusion-pipe's cross_attn_lr / self_attn_lr / mlp_lr / mod_lr (Cosmos-Predict2, Anima) become group_lr
    patterns, each naming exactly that part of diffpipe's (diffusers') Cosmos-Predict2 transformer."""
    from test_anchor_config import _imported_run

    from diffpipe_cosmos.testing import TinyCosmosConfig, tiny_transformer

    run = _imported_run(tmp_path, "type = 'cosmos_predict2'\nself_attn_lr = 1e-5\ncross_attn_lr = 2e-5\n"
                                  "mlp_lr = 3e-5\nmod_lr = 4e-5\nllm_adapter_lr = 0")
    lrs = run["optimizer"]["group_lr"]
    assert lrs == {"*.attn1.*": 1e-5, "*.attn2.*": 2e-5, "*.ff.*": 3e-5, "*.norm*.linear_*": 4e-5}
    model = tiny_transformer(TinyCosmosConfig())
    trainable = {n: torch.nn.Parameter(torch.zeros(1)) for n, _ in model.named_parameters()}
    by_id = {id(p): n for n, p in trainable.items()}
    groups = {g["name"]: [by_id[id(p)] for p in g["params"]] for g in parameter_groups(
        OptimizerConfig(group_lr=lrs), trainable, None)}
    assert set(groups) == {"model", *lrs}
    parts = {"*.attn1.*": ".attn1.", "*.attn2.*": ".attn2.", "*.ff.*": ".ff.", "*.norm*.linear_*": ".linear_"}
    for pattern, part in parts.items():
        assert groups[pattern] and all(part in n for n in groups[pattern]), (pattern, groups[pattern][:3])


# ------------------------------------------------------------------------------------------ the memory plan
def test_the_memory_plan_counts_the_ema_kept_on_the_stage_and_the_exclusions(tmp_path: Path) -> None:
    """An [ema] on the stage's device adds one copy of each layer's trained tensors to its state; on the CPU it adds
    nothing to the stage; exclude_modules takes block 0's adapter out of the plan's trained tensors."""
    from diffpipe_core.engine.stage_costs import layer_costs
    from diffpipe_reference.model import write_tiny_model

    write_tiny_model(tmp_path / "model")
    plugin = get_registry().model("reference")

    def costs(extra: str = "", adapter: str = "") -> list:
        text = (f"output_dir = 'out'\n{extra}\n[model]\ntype = 'reference'\npath = 'model'\n[adapter]\nrank = 4\n"
                f"{adapter}")
        (tmp_path / "run.toml").write_text(text)
        cfg = load_config(tmp_path / "run.toml", get_registry(), purpose="sample")
        model = plugin.require("load_diffusion_model", model_config=cfg.model, device=torch.device("meta"),
                               dtype=torch.float32)
        layers = plugin.require("split_into_layers", model=model, model_config=cfg.model)
        return layer_costs(cfg, plugin, model, layers).layers

    plain, on_stage, on_cpu = costs(), costs("[ema]\ndevice = 'stage'"), costs("[ema]\ndevice = 'cpu'")
    assert any(layer.trainable_bytes for layer in plain)
    for a, b, c in zip(plain, on_stage, on_cpu, strict=True):
        assert b.state_bytes == a.state_bytes + a.trainable_bytes and c.state_bytes == a.state_bytes
    excluded = costs(adapter="exclude_modules = ['^blocks\\.0\\.']")
    assert excluded[1].trainable == 0 < plain[1].trainable  # layer 1 is block 0
    assert [e.trainable for e in excluded[2:]] == [p.trainable for p in plain[2:]]


def test_names_that_match_nothing_are_refused_before_any_work(tmp_path: Path) -> None:
    """What `validate` and `train` check on the meta-device model before any work: an exclude_modules regex, a
    group_lr pattern or a merged file that names nothing of this model is refused, naming it."""
    from diffpipe_core.preflight import trained_name_problems
    from diffpipe_reference.model import write_tiny_model

    write_tiny_model(tmp_path / "model")
    save_file({"transformer.double_blocks.0.qkv.lora_A.weight": torch.zeros(2, 4),
               "transformer.double_blocks.0.qkv.lora_B.weight": torch.zeros(4, 2)}, str(tmp_path / "flux.safetensors"))
    save_file({"transformer.blocks.0.fc1.lora_A.weight": torch.zeros(2, 64),
               "transformer.blocks.0.fc1.lora_B.weight": torch.zeros(128, 2)}, str(tmp_path / "ours.safetensors"))
    plugin = get_registry().model("reference")

    def problems(model: str = "", adapter: str = "", optimizer: str = "") -> list[str]:
        (tmp_path / "run.toml").write_text(f"output_dir = 'out'\n[model]\ntype = 'reference'\npath = 'model'\n{model}"
                                           f"\n[adapter]\n{adapter}\n[optimizer]\n{optimizer}\n")
        return trained_name_problems(load_config(tmp_path / "run.toml", get_registry(), purpose="sample"), plugin)

    assert problems("merge_adapters = [{ path = 'ours.safetensors' }]", "exclude_modules = ['fc2']",
                    "group_lr = { '*.fc1.*' = 1e-4 }") == []
    assert "exclude_modules: 'norm_out' matches none" in problems(adapter="exclude_modules = ['norm_out']")[0]
    assert "group_lr: pattern '*.ff.*' matches none of the 48 trained parameters" in problems(
        optimizer="group_lr = { '*.ff.*' = 1e-4 }")[0]
    assert "flux.safetensors: 'transformer.double_blocks.0.qkv.lora_A.weight' names no module" in problems(
        "merge_adapters = [{ path = 'flux.safetensors' }]")[0]


def test_a_native_layout_comfyui_lora_merges_like_its_diffusers_twin(tmp_path: Path) -> None:
    """Flux's ComfyUI LoRA, as the plugin exports it (BFL names, q/k/v fused into qkv and linear1, per-module
    .alpha), merged through the plugin's original_weight_targets gives the base the same LoRA's diffusers file
    gives: each fused update cut into the right model tensors, at the right strength."""
    from diffpipe_core.adapters import adapter_state_dict
    from diffpipe_core.merge_adapters import native_targets
    from diffpipe_core.schema import validate
    from diffpipe_core.testing.runs import with_random_lora
    from diffpipe_flux.testing import write_tiny_flux

    plugin = get_registry().model("flux")
    cfg = validate(plugin.spec.config_schema, {"type": "flux", "path": write_tiny_flux(tmp_path / "flux"),
                                               "dtype": "float32"}, "test")

    def load() -> torch.nn.Module:
        return plugin.require("load_diffusion_model", model_config=cfg, device=torch.device("cpu"),
                              dtype=torch.float32)

    qkv = "diffusion_model.double_blocks.0.img_attn.qkv.weight"
    made = plugin.call("original_weight_targets", model_config=cfg, keys=[qkv, "diffusion_model.nothing.weight"])
    assert list(made) == [qkv] and [name for name, _ in made[qkv]] == [
        f"transformer_blocks.0.attn.to_{p}.weight" for p in "qkv"]
    torch.manual_seed(0)
    targets = plugin.require("lora_targets", model_config=cfg)
    lora = {k: v.contiguous() for k, v in adapter_state_dict(with_random_lora(load(), targets)).items()}
    comfy = plugin.require("export_adapter", state_dict=lora, alpha=6.0, rank=4, format="comfyui")
    assert any(".img_attn.qkv." in k for k in comfy) and any(".linear1." in k for k in comfy)
    save_file({k: v.contiguous() for k, v in comfy.items()}, str(tmp_path / "comfy.safetensors"))
    twin = {f"transformer.{k}": v for k, v in lora.items()}
    twin |= {f"transformer.{k.removesuffix('.lora_A.weight')}.alpha": torch.tensor(6.0) for k in lora
             if k.endswith(".lora_A.weight")}
    save_file(twin, str(tmp_path / "diffusers.safetensors"))

    base = {k: v.clone() for k, v in load().state_dict().items()}
    native, merged = load(), load()
    assert merge_into(native, [MergedAdapter(path=tmp_path / "comfy.safetensors", weight=0.7)], "transformer",
                      native_targets(plugin, cfg)) > 0
    merge_into(merged, [MergedAdapter(path=tmp_path / "diffusers.safetensors", weight=0.7)], "transformer")
    got, expected = native.state_dict(), merged.state_dict()
    changed = {k for k in base if not torch.equal(expected[k], base[k])}
    assert {k.removesuffix(".lora_A.weight") + ".weight" for k in lora if k.endswith(".lora_A.weight")} == changed
    for key in base:
        assert torch.allclose(got[key], expected[key], atol=1e-5), key
