"""Shared diffusion maths and the LoRA helpers (in-process, fast)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from peft.tuners.lora import LoraLayer
from safetensors import safe_open

from diffpipe_core.adapters import (
    apply_lora,
    diffusers_format,
    load_adapter,
    lora_config,
    lora_state_dict,
    save_adapter,
)
from diffpipe_core.diffusion import (
    flow_matching_pair,
    flux_resolution_shift,
    masked_mse,
    sample_timesteps,
    shift_timesteps,
)
from diffpipe_reference.model import TinyDiT, TinyDiTConfig


def test_logit_normal_matches_its_distribution() -> None:
    g = torch.Generator().manual_seed(0)
    t = sample_timesteps(200_000, g, "logit_normal", sigmoid_scale=1.0)
    logits = torch.log(t / (1 - t))
    assert abs(logits.mean().item()) < 0.01 and abs(logits.std().item() - 1.0) < 0.01
    t2 = sample_timesteps(200_000, torch.Generator().manual_seed(0), "logit_normal", sigmoid_scale=2.0)
    assert abs(torch.log(t2 / (1 - t2)).std().item() - 2.0) < 0.02


def test_uniform_and_shift() -> None:
    t = sample_timesteps(100_000, torch.Generator().manual_seed(1), "uniform")
    assert abs(t.mean().item() - 0.5) < 0.01 and t.min() >= 0 and t.max() <= 1
    shifted = shift_timesteps(torch.tensor([0.25, 0.5]), 3.0)
    assert torch.allclose(shifted, torch.tensor([0.75 / 1.5, 1.5 / 2.0]))
    assert shift_timesteps(t, 1.0) is t


def test_quantiles_are_the_distribution_quantiles() -> None:
    g = torch.Generator().manual_seed(2)
    samples = sample_timesteps(400_000, g, "logit_normal", sigmoid_scale=1.5, shift=2.0)
    for q in (0.1, 0.5, 0.9):
        fixed = sample_timesteps(3, g, "logit_normal", sigmoid_scale=1.5, shift=2.0, quantile=q)
        assert torch.all(fixed == fixed[0])
        assert abs(fixed[0].item() - torch.quantile(samples[:100_000], q).item()) < 0.01


def test_flux_shift_formula() -> None:
    assert flux_resolution_shift(256) == pytest.approx(math.exp(0.5))
    assert flux_resolution_shift(4096) == pytest.approx(math.exp(1.15))
    assert flux_resolution_shift(1024) == pytest.approx(math.exp(0.5 + (1.15 - 0.5) * (1024 - 256) / (4096 - 256)))


def test_flow_matching_pair_and_masked_mse() -> None:
    x, noise, t = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2), torch.tensor([0.0, 0.5, 1.0])
    x_t, target = flow_matching_pair(x, noise, t)
    assert torch.allclose(x_t[0], x[0]) and torch.allclose(x_t[2], noise[2])
    assert torch.allclose(x_t[1], 0.5 * x[1] + 0.5 * noise[1]) and torch.allclose(target, noise - x)
    pred = torch.zeros(1, 1, 2, 2)
    tgt = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    mask = torch.tensor([[[[1.0, 0.0], [0.0, 0.0]]]])
    assert masked_mse(pred, tgt).item() == pytest.approx(7.5)
    assert masked_mse(pred, tgt, mask).item() == pytest.approx(1.0)


def tiny() -> TinyDiT:
    torch.manual_seed(0)
    return TinyDiT(TinyDiTConfig(dim=32, depth=2, heads=2))


def test_alpha_is_honoured() -> None:
    model = apply_lora(tiny(), lora_config(rank=4, alpha=12, dropout=0.0, target_modules=["to_q"]))
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    assert len(layers) == 2 and all(m.scaling["default"] == pytest.approx(3.0) for m in layers)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_unmatched_targets_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="matched nothing"):
        apply_lora(tiny(), lora_config(4, 4, 0.0, ["no_such_module"]))


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    config = lora_config(rank=4, alpha=8, dropout=0.0, target_modules=["to_q", "fc1"])
    trained = apply_lora(tiny(), config)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.normal_()
    state = lora_state_dict(trained)
    assert all(".default" not in k for k in state)
    files = {"adapter_model.safetensors": diffusers_format(state, "transformer")}
    save_adapter(tmp_path / "a", files, config, torch.float32, "transformer")
    with safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    assert "transformer.blocks.0.attn.to_q.lora_A.weight" in keys
    assert not any(k.endswith(".alpha") for k in keys)  # diffusers reads alpha from the metadata
    assert meta["transformer.lora_alpha"] == 8 and meta["transformer.r"] == 4
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["r"] == 4

    x, t, text = torch.randn(1, 4, 8, 8), torch.rand(1), torch.randn(1, 16, 32)
    fresh = load_adapter(tiny(), tmp_path / "a")
    with torch.no_grad():
        assert torch.allclose(fresh(x, t, text), trained(x, t, text), atol=1e-6)
        assert not torch.allclose(tiny()(x, t, text), trained(x, t, text), atol=1e-3)


def test_missing_adapter_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no adapter found"):
        load_adapter(tiny(), tmp_path)
