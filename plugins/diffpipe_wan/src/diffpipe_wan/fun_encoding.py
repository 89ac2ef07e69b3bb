"""The Wan Fun-Control conditioning on the transformer's channels (:mod:`diffpipe_wan.fun`'s docstring)."""

from __future__ import annotations

import torch

MASK_CHANNELS = 4  # Wan 2.2 Fun-Control's mask (the 4 pixel frames of each latent frame)


def condition(control: torch.Tensor, in_channels: int) -> torch.Tensor:
    """``(B, in_channels - z, F', h, w)``: the normalised control latents ``(B, z, F', h, w)``, then (``in_channels``
    = 3z + 4) a zero mask, then zero start-image latents: no start image, as ComfyUI conditions the model without
    one."""
    z = control.shape[1]
    if in_channels not in (3 * z, 3 * z + MASK_CHANNELS):
        raise ValueError(f"a Wan Fun-Control transformer takes {3 * z} or {3 * z + MASK_CHANNELS} channels for {z} "
                         f"latent channels, not {in_channels}")
    mask = control.new_zeros(control.shape[0], in_channels - 3 * z, *control.shape[2:])
    return torch.cat([control, mask, torch.zeros_like(control)], dim=1)
