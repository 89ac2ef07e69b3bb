"""Issue 42, round two, in-process: regularisation folders and loss weights (the dataset keys, the per-sample loss,
the base model as peft's adapter-disabled forward or the initial weights), gradient release (each parameter stepped
from its post-accumulate-grad hook equals a plain step; no full gradient buffer) and their bad values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from diffpipe_core.config import RunConfig
from diffpipe_core.data.cache import CacheEntry, SampleRoles
from diffpipe_core.data.dataset_config import load_dataset_config
from diffpipe_core.data.items import Bucket
from diffpipe_core.engine.regularization import FrozenBase, MicroRoles, take, weighted_loss
from diffpipe_core.optim.gradient_release import GradientRelease
from diffpipe_core.parts.flow import flow_loss
from diffpipe_core.schema import ConfigError
from diffpipe_core.types import TrainingContext

# ------------------------------------------------------------------------------------------ dataset keys


def _dataset_toml(tmp_path: Path, extra: str) -> Path:
    for name in ("train", "reg"):
        (tmp_path / name).mkdir(exist_ok=True)
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'[[directory]]\npath = "train"\n\n[[directory]]\npath = "reg"\n{extra}')
    return toml


def test_regularization_keys_and_their_default(tmp_path: Path) -> None:
    cfg = load_dataset_config(_dataset_toml(tmp_path, "regularization = true\nloss_weight = 0.5\n"))
    train, reg = cfg.directory
    assert (train.regularization, train.loss_weight, train.trains_toward_base) == (False, 1.0, False)
    # the default target is the captions' (kohya's is_reg): no extra forward
    assert (reg.regularization, reg.regularization_target, reg.loss_weight, reg.trains_toward_base) == (
        True, None, 0.5, False)
    cfg = load_dataset_config(_dataset_toml(tmp_path, 'regularization = true\nregularization_target = "base"\n'))
    assert cfg.directory[1].trains_toward_base


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ("regularization = true\nloss_weight = 0\n", "loss_weight"),
        ("regularization = true\nloss_weight = -1\n", "loss_weight"),
        ('regularization = true\nregularization_target = "prior"\n', "regularization_target"),
        ('regularization_target = "base"\n', "regularization_target"),
        ('regularization = "yes please"\n', "regularization"),
    ],
)
def test_bad_regularization_values_are_refused_naming_the_key(tmp_path: Path, extra: str, named: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_dataset_config(_dataset_toml(tmp_path, extra))
    assert named in str(err.value) and "directory" in str(err.value), str(err.value)


def test_sample_roles_follow_each_entrys_directory(tmp_path: Path) -> None:
    cfg = load_dataset_config(_dataset_toml(
        tmp_path, 'regularization = true\nregularization_target = "base"\nloss_weight = 0.25\n'))
    entries = [CacheEntry(f"e{k}", Bucket(64, 64), 1, f"m{k}", ("c",), directory=k % 2) for k in range(4)]
    roles = SampleRoles.of(entries, cfg.directory)
    assert roles.weight.tolist() == [1.0, 0.25, 1.0, 0.25] and roles.base.tolist() == [False, True, False, True]
    assert roles.weighted and roles.any_base
    plain = SampleRoles.of(entries, ())
    assert not plain.weighted and not plain.any_base


def test_the_cache_index_keeps_each_entrys_directory(tmp_path: Path) -> None:
    from diffpipe_core.data.cache import _read_index, _write_index

    entries = [CacheEntry("a", Bucket(64, 64), 1, "m1", ("c1",)),
               CacheEntry("b", Bucket(64, 64), 2, "m2", ("c2",), ("k",), (Bucket(32, 32),), directory=3),
               CacheEntry("c", Bucket(64, 32), 1, "m3", ("c3",), directory=1)]
    _write_index(tmp_path / "index.json", "fp", entries, [])
    assert _read_index(tmp_path / "index.json", "fp")["entries"] == entries


# ------------------------------------------------------------------------------------------ the loss

CONTEXT = TrainingContext(model_config=None)


def _plugin_loss(outputs, targets):
    return flow_loss(outputs, targets, CONTEXT)


def test_weighted_loss_is_the_weighted_mean_of_the_samples_losses() -> None:
    gen = torch.Generator().manual_seed(0)
    pred, target = torch.randn(4, 3, 5, generator=gen), torch.randn(4, 3, 5, generator=gen)
    per_sample = ((pred - target) ** 2).mean(dim=(1, 2))
    # one weight for all: the plugin's loss times it (exactly the plugin's at 1)
    same = MicroRoles([1.0] * 4, [False] * 4)
    assert torch.equal(weighted_loss(same, (pred,), (pred,), (target,), _plugin_loss, CONTEXT),
                       _plugin_loss((pred,), (target,)))
    half = MicroRoles([0.5] * 4, [False] * 4)
    assert torch.allclose(weighted_loss(half, (pred,), (pred,), (target,), _plugin_loss, CONTEXT),
                          0.5 * per_sample.mean())
    mixed = MicroRoles([1.0, 0.25, 1.0, 0.25], [False] * 4)
    want = (per_sample * torch.tensor([1.0, 0.25, 1.0, 0.25])).mean()
    assert torch.allclose(weighted_loss(mixed, (pred,), (pred,), (target,), _plugin_loss, CONTEXT), want)


def test_base_target_items_train_toward_the_base_prediction_and_others_keep_theirs() -> None:
    gen = torch.Generator().manual_seed(1)
    pred = torch.randn(3, 4, 6, generator=gen, requires_grad=True)
    target, base = torch.randn(3, 4, 6, generator=gen), torch.randn(3, 4, 6, generator=gen)
    mask = torch.ones(3, 4, 6)
    role = MicroRoles([1.0, 0.5, 0.5], [False, True, True], base_outputs=(base,))
    loss = weighted_loss(role, (pred,), (pred,), (target, mask), _plugin_loss, CONTEXT)
    want = (((pred[0] - target[0]) ** 2).mean() + 0.5 * ((pred[1:] - base[1:]) ** 2).mean() * 2) / 3
    assert torch.allclose(loss, want)
    loss.backward()
    # the base outputs carry no gradient: the base-target samples' gradient is toward base, not the data's target
    expected = torch.zeros_like(pred)
    expected[0] = 2 * (pred[0] - target[0]).detach() / pred[0].numel() / 3
    expected[1:] = 0.5 * 2 * (pred[1:] - base[1:]).detach() / pred[1:].numel() * 2 / 3
    assert torch.allclose(pred.grad, expected, atol=1e-7)
    with pytest.raises(RuntimeError, match="no base model outputs"):
        weighted_loss(MicroRoles([1.0] * 3, [True] * 3), (pred,), (pred,), (target,), _plugin_loss, CONTEXT)


def test_take_slices_the_batch_tensors_only() -> None:
    out = take((torch.arange(6).view(3, 2), torch.tensor(7.0), [torch.arange(3)], "x"), torch.tensor([0, 2]), 3)
    assert out[0].tolist() == [[0, 1], [4, 5]] and out[1].item() == 7.0 and out[2][0].tolist() == [0, 2]
    assert out[3] == "x"


def test_the_frozen_base_disables_the_adapter_or_swaps_in_the_initial_weights() -> None:
    from diffpipe_core.adapters import apply_lora, lora_config

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    before = model(x).detach()
    apply_lora(model, lora_config(2, 2, 0.0, ["0", "1"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p)
    trained = model(x).detach()
    assert not torch.allclose(trained, before)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    base = FrozenBase(model, trainable, adapter=True)
    with base.active():
        assert torch.allclose(model(x), before)
    assert torch.allclose(model(x), trained) and all(p.requires_grad for p in trainable.values())
    # a full fine-tune: the initial weights, in host memory, swapped in and back
    full = nn.Linear(4, 2)
    weights = {n: p for n, p in full.named_parameters()}
    initial = full(x).detach()
    base = FrozenBase(full, weights, adapter=False)
    assert base.host_bytes == sum(p.numel() * 4 for p in weights.values())
    with torch.no_grad():
        full.weight.add_(1.0)
    moved = full(x).detach()
    with base.active():
        assert torch.allclose(full(x), initial)
    assert torch.allclose(full(x), moved)


# ------------------------------------------------------------------------------------------ gradient release


def _net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_gradient_release_steps_like_a_plain_step_without_a_full_gradient_buffer(clip: float) -> None:
    plain, released = _net(), _net()
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt_rel = torch.optim.AdamW(released.parameters(), lr=1e-2)
    release = GradientRelease(opt_rel, list(released.parameters()), clip)
    gen = torch.Generator().manual_seed(4)
    total = sum(p.numel() * 4 for p in released.parameters())
    for _ in range(3):
        x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)
        opt_plain.zero_grad()
        ((plain(x) - y) ** 2).mean().backward()
        if clip:  # gradient release clips each parameter by its own norm
            for p in plain.parameters():
                torch.nn.utils.clip_grad_norm_([p], clip)
        opt_plain.step()
        release.start_step()
        ((released(x) - y) ** 2).mean().backward()  # the hooks step every parameter here
        assert release.stepped == 6 and all(p.grad is None for p in released.parameters())
        # one gradient at a time, never the whole buffer: the largest single gradient
        assert release.peak_bytes == max(p.numel() * 4 for p in released.parameters()) < total
        assert release.live_bytes == 0
        opt_rel.step()  # what DeepSpeed still calls: nothing left to step
    for a, b in zip(plain.parameters(), released.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_gradient_release_skips_a_non_finite_gradient() -> None:
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    release = GradientRelease(opt, list(net.parameters()), 0.0)
    before = [p.detach().clone() for p in net.parameters()]
    release.start_step()
    (net(torch.ones(2, 8)).sum() * float("nan")).backward()  # every gradient nan
    assert release.nonfinite and not torch.isfinite(release.step_norm()) and release.stepped == 0
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    assert all(p.grad is None for p in net.parameters()) and release.live_bytes == 0


def test_gradient_release_bad_values_are_refused_naming_the_key() -> None:
    base = {"model": {"type": "reference"}, "optimizer": {"gradient_release": True}}
    RunConfig(**base)  # a full fine-tune at gradient_accumulation_steps 1: fine
    with pytest.raises(ValueError, match=r"optimizer\.gradient_release: needs gradient_accumulation_steps = 1"):
        RunConfig(**base, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match=r"optimizer\.gradient_release: only for full fine-tunes"):
        RunConfig(**base, adapter={"rank": 4})
    with pytest.raises(ValueError, match=r"optimizer\.gradient_release: 'prodigy' updates its parameters together"):
        RunConfig(model={"type": "reference"}, optimizer={"gradient_release": True, "type": "prodigy"})


def test_sample_roles_arrays_are_numpy() -> None:
    roles = SampleRoles(np.array([1.0, 2.0]), np.array([False, False]))
    assert roles.weighted and not roles.any_base


# ------------------------------------------------------------------------------------------ DOP


def test_dop_keys_class_prompts_and_bad_values(tmp_path: Path) -> None:
    toml = _dataset_toml(tmp_path, "")
    body = toml.read_text()
    toml.write_text('trigger_word = "ohwx"\ndiff_output_preservation = true\n' + body)
    cfg = load_dataset_config(toml)
    assert cfg.diff_output_preservation_class == "person" and cfg.diff_output_preservation_multiplier == 1.0
    assert cfg.class_prompt("a photo of ohwx, ohwx smiling") == "a photo of person, person smiling"
    for top, named in (("diff_output_preservation = true\n", "trigger_word"),
                       ('trigger_word = "x"\ndiff_output_preservation = true\n'
                        "diff_output_preservation_multiplier = 0\n", "diff_output_preservation_multiplier")):
        toml.write_text(top + body)
        with pytest.raises(ConfigError, match=named):
            load_dataset_config(toml)


def test_dop_loss_adds_the_class_prompts_term_to_the_captions_loss() -> None:
    from diffpipe_core.engine.regularization import concat_batches

    gen = torch.Generator().manual_seed(2)
    n = 3
    pred = torch.randn(2 * n, 4, 5, generator=gen)
    target = torch.randn(n, 4, 5, generator=gen)
    prior = torch.randn(n, 4, 5, generator=gen)
    targets = concat_batches((target,), (target,), n)
    assert targets[0].shape[0] == 2 * n
    role = MicroRoles([1.0, 1.0, 0.5], [False] * 3, dop=[True, True, False], dop_multiplier=2.0,
                      dop_outputs=(prior,))
    loss = weighted_loss(role, (pred,), (pred,), targets, _plugin_loss, CONTEXT)
    per = ((pred[:n] - target) ** 2).mean(dim=(1, 2))
    main = (per * torch.tensor([1.0, 1.0, 0.5])).mean()
    dop = ((pred[n:n + 2] - prior[:2]) ** 2).mean() * 2.0 * 2 / 3
    assert torch.allclose(loss, main + dop)
    with pytest.raises(ValueError, match="cannot share a micro-batch"):
        concat_batches((torch.zeros(2, 7),), (torch.zeros(2, 9),), 2)
    assert concat_batches((torch.zeros(2, 3), torch.ones(5)), (torch.zeros(2, 3), torch.ones(5)), 2)[1].shape == (5,)


# ------------------------------------------------------------------------------------------ reports and importer


def test_diffpipe_data_lists_regularisation_folders_weights_and_dop(tmp_path: Path) -> None:
    from diffpipe_core.data.report import format_report
    from diffpipe_core.data.scan import scan_dataset
    from diffpipe_core.registry import get_registry
    from diffpipe_core.testing.media import write_image_dataset

    toml = _dataset_toml(tmp_path, 'regularization = true\nregularization_target = "base"\nloss_weight = 0.5\n'
                                   "num_repeats = 2\n")
    write_image_dataset(tmp_path / "train", 3, captions=["ohwx a", "ohwx b", "c"])
    write_image_dataset(tmp_path / "reg", 2, seed=3)
    toml.write_text('trigger_word = "ohwx"\ndiff_output_preservation = true\nresolutions = [64]\n' + toml.read_text())
    cfg = load_dataset_config(toml)
    scan = scan_dataset(cfg, get_registry().model("reference").spec)
    report = format_report(scan, 1, 1, cfg)
    assert "directory[1] (" in report and "4 samples per epoch, regularisation, toward the base model's own" in report
    assert "loss_weight 0.5" in report and "training (not regularisation) samples per epoch: 3" in report
    assert "replace 'ohwx' by 'person' (2 of 3 training items' captions hold it), multiplier 1" in report
    assert "Regularisation" not in format_report(scan, 1, 1)  # without the config: as before


@pytest.mark.parametrize(
    ("anchor", "carried"),
    [({"gradient_accumulation_steps": 1}, True), ({"gradient_accumulation_steps": 4}, False),
     ({"adapter": {"type": "lora"}}, False)],
)
def test_the_importer_maps_gradient_release(anchor: dict, carried: bool) -> None:
    from diffpipe_core.anchor.keys import OPTIMIZER_RULES, Context

    (change,) = OPTIMIZER_RULES["gradient_release"]("gradient_release", True, Context(anchor=anchor))
    assert change.carried == carried
    if carried:
        assert (change.section, change.key, change.value) == ("optimizer", "gradient_release", True)
        RunConfig(model={"type": "reference"}, optimizer={"gradient_release": change.value})
    else:
        assert change.why


def test_gradient_release_with_an_offloaded_state_keeps_the_state_in_host_memory() -> None:
    from diffpipe_core.optim.offload import offload_state

    plain, released = _net(), _net()
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt_rel = offload_state(torch.optim.AdamW(released.parameters(), lr=1e-2))
    release = GradientRelease(opt_rel, list(released.parameters()), 0.0)
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    for _ in range(2):
        opt_plain.zero_grad()
        ((plain(x) - y) ** 2).mean().backward()
        opt_plain.step()
        release.start_step()
        ((released(x) - y) ** 2).mean().backward()
        assert release.stepped == 6
    for a, b in zip(plain.parameters(), released.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
        assert all(t.device.type == "cpu" for t in opt_rel.state[b].values() if torch.is_tensor(t))


def test_combinations_that_cannot_run_are_refused_before_work() -> None:
    from types import SimpleNamespace as NS

    from diffpipe_core.cli_common import training_method_problems

    def cfg(guidance=None, release=False, seq=1):
        run = NS(optimizer=NS(gradient_release=release), sequence_parallel=seq)
        return NS(model=NS(cfg=guidance), run=run, path="run.toml")

    dop, plain = NS(diff_output_preservation=True, source="d.toml"), NS(diff_output_preservation=False, source="d")
    assert training_method_problems(cfg(3.0), plain, 1) == [] and training_method_problems(cfg(), dop, 1) == []
    (problem,) = training_method_problems(cfg(3.0), dop, 1)
    assert "diff_output_preservation cannot be combined with [model] cfg" in problem
    assert training_method_problems(cfg(release=True), plain, 1) == []
    (problem,) = training_method_problems(cfg(release=True), plain, 2)
    assert problem.startswith("run.toml: optimizer.gradient_release: 2 data-parallel replicas")
    (problem,) = training_method_problems(cfg(release=True, seq=2), plain, 1)
    assert problem.startswith("run.toml: optimizer.gradient_release: sequence_parallel = 2")
