"""The reference of a text encoder loaded with ``[model] encoder_quantize = "nf4"``: the same encoder in full
precision with each weight that bitsandbytes holds in nf4 put through bitsandbytes' own nf4 round trip (quantize,
dequantize), so a test can compare the quantized encoder's outputs with it closely rather than with a loose
tolerance against the full encoder (whose gap grows with the depth of the model)."""

from __future__ import annotations

from torch import nn


def nf4_round_trip(model: nn.Module, quantized: nn.Module) -> int:
    """In place: each ``nn.Linear`` of ``model`` whose module of the same name in ``quantized`` (the same model
    loaded with ``encoder_quantize = "nf4"``) is a bitsandbytes ``Linear4bit`` gets its weight quantized to nf4 and
    dequantized again, in that module's block size; returns how many (0: nothing was quantized)."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    count = 0
    held = dict(quantized.named_modules())
    for name, module in model.named_modules():
        other = held.get(name)
        if type(module) is not nn.Linear or not isinstance(other, bnb.nn.Linear4bit):
            continue
        blocksize = other.weight.quant_state.blocksize
        weight, state = quantize_4bit(module.weight.data, blocksize=blocksize, quant_type="nf4")
        module.weight.data = dequantize_4bit(weight, state).to(module.weight.dtype)
        count += 1
    return count
