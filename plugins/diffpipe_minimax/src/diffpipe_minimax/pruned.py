"""MiniMax H3's pruned ("curve-form") checkpoint as the diffusers ``MiniMaxH3Transformer3DModel``.

The released ``minimax_h3_*_pruned*.safetensors`` files (ComfyUI's ``comfy/ldm/minimax/model.py`` at comfyanonymous/
ComfyUI 003617c, ``adaln_curve_grid``) hold no time MLP: a top-level ``adaln_t_table`` ``[grid, r]`` (float32; 1025 x
8 in the releases) samples the time-embedding curve, and every AdaLN projection (each block's ``adaln_proj.linear``,
the final layer's ``final_layer.adaln_proj.linear``) is ``[out, r]``, its bias unchanged. For the model's times ``t``
(``1 - sigma``)::

    pos  = clamp(t, 0, 1) * (grid - 1);  i0 = min(floor(pos), grid - 2)
    c(t) = lerp(table[i0], table[i0 + 1], pos - i0)        # float32
    m(t) = adaln_proj.linear(c(t))                          # no silu: the table holds silu(e(t)) projected

(``table = G V_r`` of the full model's ``G = silu(e(t_grid))``, ``W_reduced = W V_r``.) ComfyUI keeps the reduced
projections in float32 and casts a block's modulation to the stream's dtype; the final layer's stays float32.

:func:`to_curve_form` turns a built model into that form in place: ``time_proj`` becomes the identity and
``time_embedder`` a :class:`CurveTimeEmbedding` (whose ``table`` the key table names ``adaln_t_table``), the AdaLN
modules drop their silu. Module names are unchanged, so the layers, the key table, per-stage loading and the LoRA
targets (which leave ``adaln`` out, as the anchor does) work on both forms, and a LoRA trained on one loads on the
other.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_minimax_h3 import (
    MiniMaxH3AdaLayerNormModulation,
    MiniMaxH3AdaLayerNormOut,
)
from torch import nn


class CurveTimeEmbedding(nn.Module):
    """``c(t)``: the linear interpolation of ``table`` ``[grid, r]`` at the model's times ``t`` (in ``[0, 1]``)."""

    def __init__(self, grid: int, width: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        if grid < 2:
            raise ValueError(f"adaln_t_table has {grid} rows; the curve form needs at least 2")
        self.table = nn.Parameter(torch.empty(grid, width, dtype=torch.float32, device=device))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        table = self.table
        pos = t.float().clamp(0.0, 1.0) * (table.shape[0] - 1)
        i0 = pos.floor().long().clamp(max=table.shape[0] - 2)
        return torch.lerp(table[i0], table[i0 + 1], (pos - i0).unsqueeze(1))


class CurveModulation(MiniMaxH3AdaLayerNormModulation):
    """A block's AdaLN projection of ``c(t)`` (no silu), its output in the stream's dtype (``out_dtype``)."""

    out_dtype: torch.dtype = torch.float32

    def forward(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.linear(temb.float()).to(self.out_dtype)
        return out.view(-1, 6 * self.hidden_size).chunk(6, dim=-1)


class CurveOutputNorm(MiniMaxH3AdaLayerNormOut):
    """The output norm modulated by the projection of ``c(t)`` (no silu), in the projection's float32."""

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor, timestep_indices: torch.Tensor) -> torch.Tensor:
        shift, scale = self.linear(temb.float()).chunk(2, dim=-1)
        hidden_states = self.norm(hidden_states)
        return hidden_states * (1.0 + scale.index_select(0, timestep_indices)) + shift.index_select(
            0, timestep_indices)


def to_curve_form(model: nn.Module, grid: int, dtype: torch.dtype) -> nn.Module:
    """``model`` (a ``MiniMaxH3Transformer3DModel`` built with ``time_embed_dim`` = the table's width ``r``) in the
    curve form of a ``grid``-row table, in place: the table and the reduced AdaLN projections in float32 (on the
    model's device: meta for a skeleton), block modulations handed on in ``dtype``."""
    device = model.proj_in.weight.device
    model.time_proj = nn.Identity()
    model.time_embedder = CurveTimeEmbedding(grid, int(model.config.time_embed_dim), device)
    for block in model.transformer_blocks:
        block.adaln_proj.__class__ = CurveModulation
        block.adaln_proj.out_dtype = dtype
        block.adaln_proj.linear.float()
    model.norm_out.__class__ = CurveOutputNorm
    model.norm_out.linear.float()
    return model


def curve_of(model: nn.Module, grid: int, rank: int | None = None) -> dict[str, torch.Tensor]:
    """The curve form of a full model's weights, as the pruned files are made: ``G = silu(e(t))`` over ``grid``
    evenly spaced times, ``V_r`` its leading ``rank`` right singular vectors (all of them by default: then exact),
    ``time_embedder.table = G V_r`` and every AdaLN weight ``W V_r``; the time MLP left out. Diffusers' names."""
    t = torch.linspace(0.0, 1.0, grid)
    with torch.no_grad():
        curve = nn.functional.silu(model.time_embedder(model.time_proj(t).float())).double()
        basis = torch.linalg.svd(curve, full_matrices=False).Vh[:rank].T
        state = {k: t for k, t in model.state_dict().items() if not k.startswith(("time_embedder.", "time_proj."))}
        for key in [k for k in state if k.endswith(("adaln_proj.linear.weight", "norm_out.linear.weight"))]:
            state[key] = (state[key].double() @ basis).to(state[key].dtype)
        state["time_embedder.table"] = (curve @ basis).float()
    return state
