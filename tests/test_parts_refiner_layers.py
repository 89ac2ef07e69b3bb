"""``diffpipe_core.parts.refiner_layers``, the layers Lumina 2 and OmniGen2 share: the chain a plugin's first layer
heads, and the refusal of a model without one of the three kinds of block. That a chain computes the model's forward
is tested per model (plugins/diffpipe_lumina/tests/test_lumina_model.py, plugins/diffpipe_omnigen/tests/
test_omnigen_model.py), with the joint mask passed only when needed (Lumina 2) and always (OmniGen2)."""

from __future__ import annotations

import pytest
from torch import nn

from diffpipe_core.parts.refiner_layers import (
    ContextRefinerLayer,
    FinalLayer,
    MainLayer,
    NoiseRefinerLayer,
    refiner_layers,
)


class Blocks(nn.Module):
    def __init__(self, contexts: int, noises: int, mains: int) -> None:
        super().__init__()
        self.context_refiner = nn.ModuleList(nn.Identity() for _ in range(contexts))
        self.noise_refiner = nn.ModuleList(nn.Identity() for _ in range(noises))
        self.layers = nn.ModuleList(nn.Identity() for _ in range(mains))
        self.norm_out, self.out_channels = nn.Identity(), 4
        self.config = type("Config", (), {"patch_size": 2})()


def test_the_chain_and_its_last_blocks() -> None:
    first = nn.Identity()
    layers = refiner_layers(Blocks(1, 2, 2), first, always_mask=True)
    assert layers[0] is first and [type(x) for x in layers[1:]] == [
        ContextRefinerLayer, NoiseRefinerLayer, NoiseRefinerLayer, MainLayer, MainLayer, FinalLayer]
    assert [x.last for x in layers[1:-1]] == [True, False, True, False, True]
    assert all(x.always_mask for x in layers[4:6])


def test_a_model_without_a_kind_of_block_is_refused_with_its_counts() -> None:
    counts = r"num_refiner_layers = 1, num_layers = 0"
    with pytest.raises(ValueError, match=rf"Blocks without refiner or main blocks .*{counts}"):
        refiner_layers(Blocks(1, 1, 0), nn.Identity())
