"""Issue 20.8: a LoRA on a module a pipeline layer holds directly (Flux's x_embedder, context_embedder, final
proj_out) trains, for every plugin: the core points the layers at peft's wrappers after injecting. A targeted
module no layer holds is refused, and one no layer calls is named after the first backward. On the bundled Flux
plugin's tiny model and its real layer split, in-process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diffpipe_flux.layers as flux_layers
import diffpipe_flux.testing as flux_testing
from diffpipe_core.adapters import lora_config
from diffpipe_core.engine.adapter_layers import adapt_layers, lora_without_gradient

TOP_LEVEL = ["x_embedder", "context_embedder", "proj_out", "to_q"]


def _flux():
    model = flux_testing.tiny_transformer(flux_testing.TinyFluxConfig())
    return model, flux_layers.split_into_layers(model)


def _inputs(batch: int = 2, tokens: int = 16, seq: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(batch, tokens, 16, generator=g), torch.rand(batch, generator=g),
        torch.randn(batch, seq, 32, generator=g), torch.randn(batch, 32, generator=g), torch.full((batch,), 3.5),
        torch.zeros(tokens, 3), torch.zeros(seq, 3),
    )  # fmt: skip


def _train_step(layers: list[nn.Module], model: nn.Module) -> None:
    out = _inputs()
    for layer in layers:
        out = layer(out)
    out[0].square().mean().backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0).step()


def test_lora_on_top_level_linears_trains_through_the_layers() -> None:
    model, layers = _flux()
    adapt_layers(model, layers, lora_config(4, 4, 0.0, TOP_LEVEL), torch.float32)
    assert layers[0].x_embedder is model.x_embedder and layers[-1].proj_out is model.proj_out  # the wrappers
    _train_step(layers, model)
    for name in ("x_embedder", "context_embedder", "proj_out", "single_transformer_blocks.0.proj_out"):
        lora_b = model.get_submodule(name).lora_B["default"].weight
        assert lora_b.grad is not None and lora_b.abs().sum() > 0, f"{name}'s lora_B did not train"
    assert lora_without_gradient(dict(model.named_parameters())) == []


def test_a_targeted_module_no_layer_holds_is_refused() -> None:
    model, layers = _flux()
    with pytest.raises(ValueError, match="match proj_out, which no pipeline layer uses"):
        adapt_layers(model, layers[:-1], lora_config(4, 4, 0.0, ["proj_out"]), torch.float32)  # without FinalLayer


class _Holds(nn.Module):
    """A layer that holds two linears and calls one."""

    def __init__(self, used: nn.Module, unused: nn.Module) -> None:
        super().__init__()
        self.used, self.unused = used, unused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_a_targeted_module_no_layer_calls_is_named_after_the_first_backward() -> None:
    model = nn.ModuleDict({"used": nn.Linear(4, 4), "unused": nn.Linear(4, 4)})
    layer = _Holds(model["used"], model["unused"])
    adapt_layers(model, [layer], lora_config(2, 2, 0.0, ["used", "unused"]), torch.float32)
    layer(torch.randn(3, 4)).sum().backward()
    assert lora_without_gradient(dict(model.named_parameters())) == [
        "unused.lora_A.default.weight", "unused.lora_B.default.weight",
    ]  # fmt: skip


def test_a_parameter_group_that_sat_the_step_out_is_not_named() -> None:
    """A model of two networks trained in one run (Wan 2.2 A14B's experts), each its own optimizer group: a step whose
    samples all used one network leaves the other group without gradients; a module never called is still named."""
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4), "b_unused": nn.Linear(4, 4)})
    layer = _Holds(model["a"], nn.ModuleList([model["b"], model["b_unused"]]))
    adapt_layers(model, [layer], lora_config(2, 2, 0.0, ["a", "b", "b_unused"]), torch.float32)
    layer(torch.randn(3, 4)).sum().backward()  # network b sat this step out
    named = dict(model.named_parameters())
    lora = [n for n in named if "lora_" in n]
    groups = [[named[n] for n in lora if n.startswith(side)] for side in ("a.", "b")]
    assert lora_without_gradient(named, groups) == []
    assert len(lora_without_gradient(named)) == 4  # without groups, b's tensors are named
    model["b"](torch.randn(3, 4)).sum().backward()  # b used, b_unused still not: named
    assert lora_without_gradient(named, groups) == [
        "b_unused.lora_A.default.weight", "b_unused.lora_B.default.weight",
    ]  # fmt: skip


def test_a_network_the_first_step_left_out_is_not_named_without_group_lr() -> None:
    """Issue 41: Wan 2.2 A14B's two experts in one run share one optimizer group when no ``group_lr`` / ``expert_lr``
    splits them; a first step whose samples all went to one expert leaves the other's LoRA without a gradient, which
    is that network sitting the step out (the plugin's named groups), not a module outside the forward path."""
    from diffpipe_core.optim import plugin_groups

    high, low = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    trainable = {"blocks.0.attn1.to_q.lora_A.default.weight": high,
                 "transformer_2.blocks.0.attn1.to_q.lora_A.default.weight": low}  # fmt: skip
    networks = plugin_groups(trainable, {"high": [r"(?!transformer_2\.)"], "low": [r"transformer_2\."]})
    assert [[id(p) for p in ps] for ps in networks] == [[id(high)], [id(low)]]
    high.grad = torch.ones(2)
    assert lora_without_gradient(trainable, networks) == []
    assert lora_without_gradient(trainable) == ["transformer_2.blocks.0.attn1.to_q.lora_A.default.weight"]
    assert plugin_groups(trainable, None) == []
