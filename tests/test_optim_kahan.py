"""Issue 10, test 2: ``adamw8bit_kahan`` keeps learning below bf16 resolution where plain AdamW stalls, and the
state of the 8-bit optimizers survives the checkpoint round trip bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe_core.config import OptimizerConfig
from diffpipe_core.engine import checkpoint as ckpt_io
from diffpipe_core.optim import build_optimizer
from diffpipe_core.optim.kahan import COMPENSATION
from diffpipe_core.registry import Registry

TARGET = 1.02  # 1.0 + 0.02: bf16 spacing at 1.0 is 2**-7 = 0.0078; each AdamW step of about lr = 1e-3 rounds away


def bf16_param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16))  # 4096 elements: 8-bit states


def optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    cfg = OptimizerConfig(type=name, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999))
    return build_optimizer(cfg, params, Registry().pm)


def descend(opt: torch.optim.Optimizer, p: torch.nn.Parameter, steps: int) -> None:
    """Gradient of (p - TARGET)^2; the true value of a Kahan weight is weight + compensation."""
    for _ in range(steps):
        value = p.detach().float()
        comp = opt.state.get(p, {}).get(COMPENSATION)
        if comp is not None:
            value = value + comp.float()
        p.grad = (2 * (value - TARGET)).to(p.dtype)
        opt.step()


def test_kahan_keeps_learning_where_bf16_adamw_stalls() -> None:
    plain_p, eight_p, kahan_p = bf16_param(), bf16_param(), bf16_param()
    plain, eight, kahan = (
        optimizer("adamw", [plain_p]),
        optimizer("adamw8bit", [eight_p]),
        optimizer("adamw8bit_kahan", [kahan_p]),
    )
    descend(plain, plain_p, 10)
    descend(eight, eight_p, 10)
    descend(kahan, kahan_p, 10)
    assert torch.equal(plain_p.detach(), torch.ones_like(plain_p)), "plain bf16 AdamW was expected to stall"
    assert torch.equal(eight_p.detach(), torch.ones_like(eight_p)), "8-bit AdamW on bf16 was expected to stall"
    state = kahan.state[kahan_p]
    assert state["state1"].dtype == torch.uint8 and state[COMPENSATION].dtype == torch.bfloat16
    true_value = kahan_p.detach().float() + state[COMPENSATION].float()
    # 10 steps of about 1e-3 each: about 0.01 of the 0.02 to go, in steps 8x below bf16 resolution
    assert 1.006 < true_value.mean().item() < TARGET
    assert kahan_p.detach().float().min().item() > 1.0  # the weight itself moved, by whole bf16 steps
    before = true_value.mean().item()
    descend(kahan, kahan_p, 10)
    after = (kahan_p.detach().float() + state[COMPENSATION].float()).mean().item()
    assert before < after <= TARGET + 1e-3 and abs(after - TARGET) < abs(before - TARGET) / 2


def assert_same(a: object, b: object, where: str = "state") -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(
            a.view(torch.uint8) if a.is_floating_point() else a, b.view(torch.uint8) if b.is_floating_point() else b
        ), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("name", ["adamw8bit", "adamw8bit_kahan"])
def test_8bit_state_round_trips_through_checkpoint(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    big = torch.nn.Parameter(torch.randn(64, 80, dtype=torch.bfloat16))  # 8-bit states (and compensation)
    small = torch.nn.Parameter(torch.randn(16, dtype=torch.float32))  # below min_8bit_size: float32 states
    opt = optimizer(name, [big, small])
    grads = [(torch.randn(64, 80, dtype=torch.bfloat16), torch.randn(16)) for _ in range(4)]
    for g_big, g_small in grads[:2]:
        big.grad, small.grad = g_big, g_small
        opt.step()
    saved = opt.state_dict()
    assert saved["state"][0]["__bnb_optimizer_quant_state__"]["state1"].dtype == torch.uint8
    ckpt = ckpt_io.write_checkpoint(
        tmp_path,
        2,
        rank=0,
        stage_id=0,
        dp_rank=0,
        params={"big": big, "small": small},
        optimizer_state={"optimizer": saved},
        train_state={"step": 2},
        keep=2,
        barrier=lambda: None,
    )
    loaded = ckpt_io.read_optimizer_state(ckpt, 0)["optimizer"]  # torch.load(weights_only=True)
    assert_same(saved, loaded)

    params = ckpt_io.read_params(ckpt)
    big2 = torch.nn.Parameter(params["big"].clone())
    small2 = torch.nn.Parameter(params["small"].clone())
    fresh = optimizer(name, [big2, small2])
    fresh.load_state_dict(loaded)
    assert_same(opt.state_dict(), fresh.state_dict())
    for g_big, g_small in grads[2:]:  # the restored optimizer continues exactly like the original
        big.grad, small.grad = g_big, g_small
        big2.grad, small2.grad = g_big.clone(), g_small.clone()
        opt.step()
        fresh.step()
    assert torch.equal(big, big2) and torch.equal(small, small2)
    assert_same(opt.state_dict(), fresh.state_dict())


def test_bf16_full_finetune_with_plain_adamw_warns(capsys: pytest.CaptureFixture[str]) -> None:
    optimizer("adamw", [bf16_param(), torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("diffpipe: warning:")]
    assert len(lines) == 1 and "adamw8bit_kahan" in lines[0] and "bfloat16" in lines[0]
    optimizer("adamw8bit_kahan", [bf16_param()])
    optimizer("adamw", [torch.nn.Parameter(torch.zeros(3))])  # float32 weights (LoRA): nothing lost
    assert "warning" not in capsys.readouterr().out
