"""The key tables' stored forms added for MiniMax H3's component files: parts interleaved per attention head
(``Module.groups``) and weight-normed convolutions folded into one weight (``form = "weight_norm"``), both ways."""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.parts.layout import WEIGHT_NORM, KeyTable, Module


def test_parts_interleaved_per_head_split_and_stack_back() -> None:
    heads, dim, width = 2, 3, 4
    state = {f"to_{p}.{param}": torch.randn(heads * dim, width) if param == "weight" else torch.randn(heads * dim)
             for p in "qkv" for param in ("weight", "bias")}
    table = KeyTable((Module("to_qkv", ("to_q", "to_k", "to_v"), groups=heads),))
    original = table.to_original(state)
    for param in ("weight", "bias"):  # [head 0: q k v; head 1: q k v]
        per_head = [state[f"to_{p}.{param}"].unflatten(0, (heads, dim)) for p in "qkv"]
        assert torch.equal(original[f"to_qkv.{param}"], torch.cat(per_head, dim=1).flatten(0, 1))
    back = table.to_model(original)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_a_folded_weight_norm_reads_as_the_same_convolution() -> None:
    conv = nn.utils.weight_norm(nn.Conv1d(3, 5, 3))
    with torch.no_grad():
        conv.weight_g.mul_(torch.rand_like(conv.weight_g) + 0.5)
    params = (("weight", "weight_v"), ("bias", "bias"))
    table = KeyTable((Module("conv", ("conv",), params=params, form=WEIGHT_NORM),))
    state = {f"conv.{k}": v.detach() for k, v in conv.state_dict().items()}
    original = table.to_original(state)
    assert sorted(original) == ["conv.bias", "conv.weight"]
    expected = torch._weight_norm(conv.weight_v, conv.weight_g, 0).detach()
    torch.testing.assert_close(original["conv.weight"], expected)
    back = table.to_model(original)
    assert sorted(back) == ["conv.bias", "conv.weight_g", "conv.weight_v"]
    torch.testing.assert_close(torch._weight_norm(back["conv.weight_v"], back["conv.weight_g"], 0), expected)
