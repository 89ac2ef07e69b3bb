"""The optimizers plugin (issue 26), in-process: found through the ``diffpipe.plugins`` entry point, built by the
core's ``build_optimizer``, and resumed from the core's checkpoint files bit for bit; schedule-free's averaged
weights inside ``evaluation_weights``. The end-to-end run (schedule-free through the CLI, resumed) is in
tests/test_logging_and_optimizers.py."""

from __future__ import annotations

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
}


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


def test_the_plugin_registers_both_through_its_entry_point() -> None:
    registry = get_registry()
    assert registry.plugins["optimizers"].is_model is False
    assert {"prodigy", "adamw_schedulefree"} <= set(available_optimizers(registry.pm))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_state_resumes_bit_identically_from_a_checkpoint(kind: str, tmp_path: Path, capfd) -> None:
    cfg = KINDS[kind]
    net = model()
    optimizer = build(cfg, net)
    assert type(optimizer).__module__.split(".")[0] in ("prodigyopt", "schedulefree")
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
