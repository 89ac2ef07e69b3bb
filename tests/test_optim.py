"""Optimizer registry (built-ins, bitsandbytes, plugin-registered) and the LR schedule."""

from __future__ import annotations

import math

import pytest
import torch

from diffpipe_core import hookimpl
from diffpipe_core.config import OptimizerConfig
from diffpipe_core.optim import build_optimizer, lr_lambda
from diffpipe_core.registry import Registry


def params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(64, 64))]


def step_once(opt: torch.optim.Optimizer, p: torch.nn.Parameter) -> None:
    p.grad = torch.ones_like(p)
    opt.step()


def test_adamw8bit_steps_on_cpu() -> None:
    p = params()
    before = p[0].detach().clone()
    opt = build_optimizer(OptimizerConfig(type="adamw8bit", lr=1e-2), p, Registry().pm)
    assert type(opt).__module__.startswith("bitsandbytes")
    step_once(opt, p[0])
    assert not torch.equal(before, p[0])


def test_unknown_optimizer_lists_available() -> None:
    with pytest.raises(ValueError, match="unknown optimizer 'lion'; available: adamw, adamw8bit, adamw8bit_kahan, sgd"):
        build_optimizer(OptimizerConfig(type="lion"), params(), Registry().pm)


def test_plugin_registered_optimizer() -> None:
    class Provider:
        @hookimpl
        def register_optimizers(self, register):
            register("plain_sgd", lambda p, lr, **_: torch.optim.SGD(p, lr=lr))

    registry = Registry()
    registry.register_generic("provider", Provider())
    p = params()
    opt = build_optimizer(OptimizerConfig(type="plain_sgd", lr=0.5), p, registry.pm)
    before = p[0].detach().clone()
    step_once(opt, p[0])
    assert torch.allclose(p[0], before - 0.5)


def test_lr_schedules() -> None:
    warm = lr_lambda("constant", 4, 100)
    assert [warm(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    linear = lr_lambda("linear", 0, 10)
    assert linear(0) == 1.0 and linear(5) == pytest.approx(0.5) and linear(10) == 0.0
    cosine = lr_lambda("cosine", 2, 12)
    assert cosine(2) == 1.0 and cosine(7) == pytest.approx(0.5) and cosine(12) == pytest.approx(0.0, abs=1e-12)
    assert cosine(4) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))


def test_the_low_precision_warning_on_a_lora_run_names_the_adapter_dtype_fix(capsys) -> None:
    """Issue 20.22: LoRA weights in bf16 are not a full fine-tune; the fix is the default float32 adapter dtype."""
    lora = [torch.nn.Parameter(torch.randn(8, 4).to(torch.bfloat16))]
    build_optimizer(OptimizerConfig(type="adamw", lr=1e-4), lora, Registry().pm, lora=True)
    said = capsys.readouterr().out
    assert "the bfloat16 LoRA weights ([adapter] dtype = 'bfloat16')" in said and "full fine-tune" not in said
    assert "leave [adapter] dtype out (its default 'float32'" in said
    build_optimizer(OptimizerConfig(type="adamw", lr=1e-4), lora, Registry().pm)  # a full fine-tune's weights
    said = capsys.readouterr().out
    assert "a full fine-tune of a bfloat16 model" in said and "adamw8bit_kahan" in said
    build_optimizer(OptimizerConfig(type="adamw", lr=1e-4), lora, Registry().pm, zero=True)  # DeepSpeed's fp32 copy
    said = capsys.readouterr().out
    assert "steps a float32 copy of this replica's share of the bfloat16 weights" in said
    assert "are lost" not in said and "adamw8bit_kahan" not in said
