"""The optimizers plugin (issue 26), in-process: found through the ``diffpipe.plugins`` entry point, built by the
core's ``build_optimizer``, and resumed from the core's checkpoint files bit for bit; schedule-free's averaged
weights inside ``evaluation_weights``. The end-to-end run (schedule-free through the CLI, resumed) is in
tests/test_logging_and_optimizers.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from diffpipe_core.config import OptimizerConfig
from diffpipe_core.engine import checkpoint as ckpt_io
from diffpipe_core.optim import available_optimizers, build_optimizer, evaluation_weights, parameter_groups
from diffpipe_core.registry import get_registry

KINDS = {
    "prodigy": OptimizerConfig(type="prodigy", lr=1.0, weight_decay=0.01, kwargs={"d_coef": 0.5}),
    "adamw_schedulefree": OptimizerConfig(type="adamw_schedulefree", lr=1e-2, kwargs={"warmup_steps": 2}),
    "adamw_optimi": OptimizerConfig(type="adamw_optimi", lr=1e-2),
    "stableadamw": OptimizerConfig(type="stableadamw", lr=1e-2),
    "automagic": OptimizerConfig(type="automagic", lr=1e-4, kwargs={"lr_bump": 1e-5}),
    "muon": OptimizerConfig(type="muon", lr=1e-2),
    "pytorch_optimizer.CAME": OptimizerConfig(type="pytorch_optimizer.CAME", lr=1e-3),
}
PACKAGES = {"prodigyopt", "schedulefree", "optimi", "diffpipe_optimizers", "pytorch_optimizer"}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    optimizer.step()


def build(cfg: OptimizerConfig, net: torch.nn.Module) -> torch.optim.Optimizer:
    trainable = dict(net.named_parameters())
    return build_optimizer(cfg, parameter_groups(cfg, trainable, None), get_registry().pm)


def test_the_plugin_registers_its_optimizers_through_its_entry_point() -> None:
    registry = get_registry()
    assert registry.plugins["optimizers"].is_model is False
    assert set(KINDS) - {"pytorch_optimizer.CAME"} | {"pytorch_optimizer.*"} <= set(available_optimizers(registry.pm))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_state_resumes_bit_identically_from_a_checkpoint(kind: str, tmp_path: Path, capfd) -> None:
    cfg = KINDS[kind]
    net = model()
    optimizer = build(cfg, net)
    assert type(optimizer).__module__.split(".")[0] in PACKAGES
    for i in range(3):
        step(net, optimizer, i)
    # the core's checkpoint files: trainable tensors (safetensors) and optimizer state (torch.save, weights_only)
    ckpt_io.write_checkpoint(
        tmp_path, 3, rank=0, stage_id=0, dp_rank=0, params=dict(net.named_parameters()),
        optimizer_state={"optimizer": optimizer.state_dict()}, train_state={"step": 3}, keep=2, barrier=lambda: None,
    )  # fmt: skip
    for i in range(3, 6):
        step(net, optimizer, i)
    resumed = model()
    ckpt = tmp_path / "checkpoints" / "step-0000003"
    with torch.no_grad():
        for name, p in resumed.named_parameters():
            p.copy_(ckpt_io.read_params(ckpt)[name])
    again = build(cfg, resumed)
    again.load_state_dict(ckpt_io.read_optimizer_state(ckpt, 0)["optimizer"])
    for i in range(3, 6):
        step(resumed, again, i)
    for (name, p), q in zip(net.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name
    state, state_again = optimizer.state_dict(), again.state_dict()
    assert state["param_groups"] == state_again["param_groups"]
    for i, entry in state["state"].items():
        for key, value in entry.items():
            other = state_again["state"][i][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (i, key)
    if kind == "prodigy":
        group = state["param_groups"][0]
        assert group["d_numerator"] != 0.0 and group["d_hat"] != group["d0"]  # its step-size estimate, resumed
    assert capfd.readouterr().out == ""  # Prodigy's "Using decoupled weight decay" stays behind --verbose


def test_schedulefree_saves_its_averaged_weights() -> None:
    net = model()
    optimizer = build(KINDS["adamw_schedulefree"], net)
    for i in range(4):
        step(net, optimizer, i)
    y = {n: p.detach().clone() for n, p in net.named_parameters()}
    beta1 = optimizer.param_groups[0]["betas"][0]
    with evaluation_weights(optimizer):
        for name, p in net.named_parameters():
            z = optimizer.state[p]["z"]
            assert torch.allclose(p, y[name] + (1 - 1 / beta1) * (z - y[name]), atol=1e-7), name  # x, not y
            assert not torch.allclose(p, y[name])
    for name, p in net.named_parameters():
        assert torch.allclose(p, y[name], atol=1e-6), name  # back to the training point
    step(net, optimizer, 4)  # still in training mode: schedule-free raises otherwise


def test_prodigy_takes_one_learning_rate() -> None:
    cfg = OptimizerConfig(type="prodigy", lr=1.0, group_lr={"b": 0.5})
    net = model()
    groups = parameter_groups(cfg, dict(net.named_parameters()), {"a": [], "b": [r"2\."]})
    with pytest.raises(ValueError, match="optimizer.group_lr: 'prodigy' takes one learning rate"):
        build_optimizer(cfg, groups, get_registry().pm)
    frozen = OptimizerConfig(type="prodigy", lr=1.0, group_lr={"b": 0.0})
    groups = parameter_groups(frozen, dict(net.named_parameters()), {"a": [], "b": [r"2\."]})
    assert [g["lr"] for g in build_optimizer(frozen, groups, get_registry().pm).param_groups] == [1.0, 0.0]


def test_unknown_optimizer_argument_names_the_key() -> None:
    cfg = OptimizerConfig(type="adamw_schedulefree", kwargs={"d_coef": 1.0})
    with pytest.raises(ValueError, match=r"optimizer.kwargs: 'adamw_schedulefree' does not take \['d_coef'\]"):
        build(cfg, model())


def bf16_step_sizes(kind: str) -> torch.Tensor:
    """How far 20 tiny steps (far below bf16's resolution near 1.0) move a bf16 weight of ones."""
    weight = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    optimizer = build_optimizer(OptimizerConfig(type=kind, lr=1e-4, weight_decay=0.0), [weight], get_registry().pm)
    for _ in range(20):
        weight.grad = torch.ones_like(weight)
        optimizer.step()
    return (weight.detach().float() - 1).abs()


@pytest.mark.parametrize("kind", ["adamw_optimi", "stableadamw"])
def test_optimi_kahan_summation_keeps_updates_below_bf16_resolution(kind: str) -> None:
    # bf16's spacing just below 1.0 is 2**-8 ~ 0.0039: plain AdamW's 1e-4 steps round away, optimi's compensated
    # ones add up to 2e-3, past half a spacing, so the weight is one spacing lower
    assert torch.equal(bf16_step_sizes("adamw"), torch.zeros(64))
    assert torch.equal(bf16_step_sizes(kind), torch.full((64,), 2.0**-8))


def test_automagic_learns_a_rate_per_element_from_sign_agreement() -> None:
    from diffpipe_optimizers.automagic import Automagic

    weight = torch.nn.Parameter(torch.zeros(2, 3))
    optimizer = Automagic([weight], lr=1e-4, lr_bump=1e-5, min_lr=5e-5, max_lr=1.2e-4)
    signs = torch.tensor([[1.0, -1.0, 1.0], [1.0, 1.0, -1.0]])
    for flip in (False, False, True):  # the last step flips the sign of column 0's gradients only
        weight.grad = signs.clone()
        if flip:
            weight.grad[:, 0] *= -1
        optimizer.step()
    rates = optimizer.state[weight]["lr_mask"].float() * optimizer.state[weight]["lr_mask_scale"]
    # step 1 compares with a polarity of "not positive": positive gradients disagree (1e-4 - bump), negative ones
    # agree (+ bump); step 2: all agree (+ bump); step 3: column 0 flips (- bump), the others agree, within max_lr
    expected = torch.tensor([[9e-5, 1.2e-4, 1.1e-4], [9e-5, 1.1e-4, 1.2e-4]])
    assert torch.allclose(rates, expected, rtol=0, atol=1.2e-4 / 127), rates  # kept as int8 x one scale
    assert weight.grad is not None and weight.detach().abs().max() > 0


def test_muon_steps_2d_weights_with_torchs_muon_and_the_rest_with_adamw() -> None:
    net = model()
    optimizer = build(KINDS["muon"], net)
    assert [(g["muon"], [p.ndim for p in g["params"]]) for g in optimizer.param_groups] == [
        (True, [2, 2]), (False, [1, 1])]  # fmt: skip
    reference = model()
    params = list(reference.parameters())
    muon = torch.optim.Muon([p for p in params if p.ndim == 2], lr=1e-2, weight_decay=0.01,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([p for p in params if p.ndim != 2], lr=1e-2, weight_decay=0.01, betas=(0.9, 0.99),
                              eps=1e-8)
    for i in range(3):
        step(net, optimizer, i)
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
        muon.zero_grad()
        adamw.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        muon.step()
        adamw.step()
    for (name, p), q in zip(net.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert set(optimizer.state[net[0].weight]) == {"momentum_buffer"}
    assert set(optimizer.state[net[0].bias]) == {"step", "exp_avg", "exp_avg_sq"}


def test_pytorch_optimizer_class_by_name_and_its_own_defaults() -> None:
    optimizer = build(KINDS["pytorch_optimizer.CAME"], model())
    assert type(optimizer).__name__ == "CAME" and type(optimizer).__module__.startswith("pytorch_optimizer")
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999, 0.9999)  # betas not set: CAME's three
    assert optimizer.param_groups[0]["lr"] == 1e-3


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (OptimizerConfig(type="pytorch_optimizer.CAMEE"),
         r"optimizer.type: pytorch-optimizer has no optimizer class 'CAMEE'; did you mean 'pytorch_optimizer.CAME'"),
        (OptimizerConfig(type="pytorch_optimizer.CAME", betas=(0.9, 0.99)),
         r"optimizer.betas: pytorch_optimizer.CAME takes 3 betas \(its default: \[0.9, 0.999, 0.9999\]\), got"),
        (OptimizerConfig(type="automagic", lr=0.1), r"optimizer.lr: automagic .* lr must be in \(0, 0.001\]"),
        (OptimizerConfig(type="muon", kwargs={"ns_stepz": 3}),
         r"optimizer.kwargs: 'muon' does not take \['ns_stepz'\]"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_before_work_naming_the_key(cfg: OptimizerConfig, message: str) -> None:
    from diffpipe_core.optim import kwargs_problems

    [problem] = kwargs_problems(cfg, get_registry().pm, "run.toml")
    assert problem.startswith("run.toml: ")
    assert re.search(message, problem), problem


def test_a_missing_package_says_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "optimi", None)  # what an uninstalled package looks like to import
    with pytest.raises(ValueError, match=r"^optimizer.type: 'adamw_optimi' needs the torch-optimi package, which is "
                                         r"not installed: pip install torch-optimi$"):
        build(KINDS["adamw_optimi"], model())
