"""The layers' random streams (engine/layer_rng.py): the same micro-batch draws the same dropout masks in a layer
whatever the layout, and activation checkpointing recomputes with the masks of the forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffpipe_core.engine.layer_rng import LayerSeeds, seed_stage_layers
from diffpipe_core.memory import CheckpointedLayer


def dropout_layers(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)) for _ in range(n)]


def run(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def test_a_micro_batch_draws_the_same_masks_on_any_layout() -> None:
    x = torch.randn(4, 8)
    # one stage, one rank: its 3rd micro-batch (global number 2)
    whole = seed_stage_layers(dropout_layers(4), range(4), LayerSeeds(7, 0, 1, 0))
    for _ in range(2):
        run(whole, x)
    expected = run(whole, x)
    # 2 stages x 2 data-parallel ranks: rank 0's 2nd micro-batch is global number 2; stage 1 gets stage 0's output
    layers = dropout_layers(4)
    first = seed_stage_layers(layers, range(2), LayerSeeds(7, 0, 2, 0))
    second = seed_stage_layers(layers, range(2, 4), LayerSeeds(7, 2, 2, 0))
    for _ in range(2):
        middle = run(first[:2], x)
        out = run(second[2:], middle)
    assert torch.equal(out, expected)
    assert not torch.equal(run(whole, x), expected)  # the next micro-batch draws other masks


def test_checkpointing_recomputes_with_the_forwards_masks() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    plain = seed_stage_layers(dropout_layers(2), range(2), LayerSeeds(3, 0, 1, 0))
    run(plain, x).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    checkpointed = seed_stage_layers([CheckpointedLayer(m, False) for m in dropout_layers(2)], range(2),
                                     LayerSeeds(3, 0, 1, 0))
    out = run(checkpointed, x)
    torch.manual_seed(99)  # whatever runs between forward and backward draws from torch's generator
    out.sum().backward()
    assert torch.equal(x.grad, expected)


def test_layer_seeding_draws_as_manual_seed_without_formatting_the_stack(monkeypatch) -> None:
    """``seed_generators`` gives the CPU draws of ``torch.manual_seed`` but queues no lazy device seeds (each of which
    formats the whole Python stack: about 1 ms per layer per micro-batch inside the pipeline engine)."""
    import traceback

    from diffpipe_core.engine.layer_rng import seed_generators

    torch.manual_seed(11)
    expected = torch.rand(4)

    def no_stack(*_args, **_kwargs):
        raise AssertionError("the stack was formatted")

    monkeypatch.setattr(traceback, "format_stack", no_stack)
    seed_generators(11)
    assert torch.equal(torch.rand(4), expected)
    if not torch.cuda.is_initialized():
        with pytest.raises(AssertionError, match="formatted"):
            torch.manual_seed(11)  # what the layers called before
