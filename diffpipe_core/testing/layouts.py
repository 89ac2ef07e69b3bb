"""Checking a plugin's original single-file key table in tests."""

from __future__ import annotations

from collections.abc import Callable

import torch

Converter = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def assert_round_trip(
    state: dict[str, torch.Tensor], to_original: Converter, to_model: Converter, swapped: tuple[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """``state`` (diffusers names) through ``to_original`` and back through ``to_model`` (from the file's
    ``model.diffusion_model.`` keys, as ComfyUI saves them) is ``state`` again, key for key and value for value.
    ``swapped = (original key, diffusers key)`` names the final modulation whose halves the two layouts store in the
    other order (original: shift first; diffusers: scale first). Returns the original-layout tensors."""
    original = to_original(state)
    if swapped is not None:
        shift, scale = original[swapped[0]].chunk(2)
        d_scale, d_shift = state[swapped[1]].chunk(2)
        assert torch.equal(shift, d_shift) and torch.equal(scale, d_scale), "the final modulation's halves"
    back = to_model({f"model.diffusion_model.{k}": v for k, v in original.items()})
    assert back.keys() == state.keys(), sorted(set(back) ^ set(state))[:5]
    assert all(torch.equal(back[k], state[k]) for k in state)
    return original
