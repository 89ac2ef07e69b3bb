"""``adamw8bit_kahan``: bitsandbytes 8-bit AdamW states with Kahan-compensated bf16/fp16 weights.

A bf16 weight has 8 significant bits: an AdamW step smaller than half its spacing (about ``|w| / 256``) is
rounded away, so a full fine-tune of a bf16 model at a small learning rate stops learning. This optimizer
keeps, per low-precision parameter, a compensation buffer in the parameter's own dtype holding what the
last rounding lost. Each step the bitsandbytes kernel updates the float32 value ``weight + compensation``;
the result is rounded back into the weight and the new rounding error into the buffer, so steps far below
the weight's resolution accumulate instead of vanishing. Memory per parameter: 2 bytes of 8-bit state and
2 bytes of compensation (plain float32 AdamW: 8 bytes of state plus a 4-byte master copy).

float32 parameters (LoRA weights, say) take the plain ``AdamW8bit`` step, without a buffer.
"""

from __future__ import annotations

from typing import Any

import bitsandbytes as bnb
import torch

COMPENSATION = "kahan_compensation"


class AdamW8bitKahan(bnb.optim.AdamW8bit):
    """``bnb.optim.AdamW8bit`` whose bf16/fp16 parameters are updated with Kahan compensation.

    The compensation buffer lives in the optimizer state (key ``kahan_compensation``), so it is saved and
    restored with ``state_dict`` / ``load_state_dict`` like the 8-bit moments.
    """

    @torch.no_grad()
    def update_step(self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int) -> None:
        if p.dtype == torch.float32:
            super().update_step(group, p, gindex, pindex)
            return
        state = self.state[p]
        if COMPENSATION not in state:
            state[COMPENSATION] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        compensation = state[COMPENSATION]
        low, low_grad = p.data, p.grad
        p.data = low.float().add_(compensation.float())  # the value the weight stands for, in float32
        p.grad = low_grad.float()
        try:
            super().update_step(group, p, gindex, pindex)  # the kernel updates p in place, in float32
            exact = p.data
        finally:
            p.data, p.grad = low, low_grad
        low.copy_(exact)
        compensation.copy_(exact.sub_(low.float()))
