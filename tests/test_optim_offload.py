"""``[optimizer] offload`` (diffpipe_core/optim/offload.py): the optimizer's own step, one parameter at a time, with
each parameter's state in host memory between steps; the same weights and state as without it, bit for bit."""

from __future__ import annotations

import pytest
import torch

from diffpipe_core.config import OptimizerConfig
from diffpipe_core.optim import build_optimizer
from diffpipe_core.optim.offload import offload_state
from diffpipe_core.registry import get_registry

KINDS = ["adamw", "adamw8bit_kahan", "automagic", "muon"]


def model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 96), torch.nn.GELU(), torch.nn.Linear(96, 64)).to(dtype)


def optimizer_for(kind: str, net: torch.nn.Module, offload: bool) -> torch.optim.Optimizer:
    cfg = OptimizerConfig(type=kind, lr=1e-4 if kind == "automagic" else 1e-2, offload=offload)
    optimizer = build_optimizer(cfg, list(net.parameters()), get_registry().pm)
    return offload_state(optimizer) if offload else optimizer


def train(net: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, 8, generator=g).to(next(net.parameters()))  # the net's dtype and device
        optimizer.zero_grad()
        net(x).float().square().mean().backward()
        optimizer.step()


@pytest.mark.parametrize("kind", KINDS)
def test_offloaded_steps_give_the_same_weights_and_state_and_resume(kind: str) -> None:
    dtype = torch.bfloat16 if kind in ("adamw8bit_kahan", "automagic") else torch.float32  # their Kahan buffers
    plain_net, off_net = model(dtype), model(dtype)
    plain, off = optimizer_for(kind, plain_net, False), optimizer_for(kind, off_net, True)
    train(plain_net, plain, range(3))
    train(off_net, off, range(3))
    for p, q in zip(plain_net.parameters(), off_net.parameters(), strict=True):
        assert torch.equal(p, q)
    saved = off.state_dict()
    again_net = model(dtype)
    with torch.no_grad():
        for p, q in zip(again_net.parameters(), off_net.parameters(), strict=True):
            p.copy_(q)
    again = optimizer_for(kind, again_net, True)
    again.load_state_dict(saved)
    train(plain_net, plain, range(3, 5))
    train(again_net, again, range(3, 5))
    for p, q in zip(plain_net.parameters(), again_net.parameters(), strict=True):
        assert torch.equal(p, q)
    assert all(v.device.type == "cpu" for s in again.state.values() for v in s.values() if torch.is_tensor(v))


class Recording(torch.optim.AdamW):
    """AdamW that records how many parameters each of its steps sees."""

    seen: list[int]

    def step(self, closure=None):  # type: ignore[override]
        self.seen.append(sum(len(g["params"]) for g in self.param_groups))
        return super().step(closure)


def test_each_underlying_step_sees_one_parameter_and_the_groups_are_restored() -> None:
    net = model()
    optimizer = Recording([{"params": list(net[0].parameters()), "lr": 1e-2},
                           {"params": list(net[2].parameters()), "lr": 1e-3}])  # fmt: skip
    optimizer.seen = []
    offload_state(optimizer)
    net[2].bias.requires_grad_(False)  # no gradient: not stepped
    train(net, optimizer, range(2))
    assert optimizer.seen == [1, 1, 1] * 2  # the device holds one parameter's state at a time
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 2]
    assert net[2].bias not in optimizer.state


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a GPU (on the CPU, state and weights share host memory; the tests above compare offloaded and plain "
    "steps there); not yet among bench/gpu_proof.sh's tests",
)
def test_on_a_gpu_the_state_stays_in_host_memory_between_steps() -> None:
    net = model().cuda()
    optimizer = optimizer_for("adamw", net, True)
    train(net, optimizer, range(2))
    devices = {v.device.type for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()}
    assert devices == {"cpu"}
    assert all(p.device.type == "cuda" for p in net.parameters())


@pytest.mark.parametrize("kind", ["prodigy", "adamw_optimi", "pytorch_optimizer.CAME"])
def test_offload_with_an_optimizer_that_steps_parameters_together_is_refused(kind: str) -> None:
    with pytest.raises(ValueError, match=rf"optimizer.offload: '{kind}' updates its parameters together .* offload "
                                         r"works with 'adamw', "):
        OptimizerConfig(type=kind, offload=True)
