"""Krea 2 cut into pipeline layers: embedders (text fusion and projection, image projection, timestep modulation,
the joint sequence's rotary table, computed once), each single-stream block, the final norm/projection.

What flows between layers (a tuple of tensors; every float tensor is used by a later layer):

- into the first layer: ``(x, t, text, text_mask, grid)``: ``x`` ``(B, N, 4C)`` the noisy latents packed 2x2 as the
  pipeline packs them, ``t`` ``(B,)`` in [0, 1], ``text`` ``(B, L, layers, d)`` the tapped Qwen3-VL states,
  ``text_mask`` ``(B, L)`` bool, ``grid`` ``(2,)`` int: the packed grid's ``(h, w)``
- between blocks: ``(joint, temb, modulation, cos, sin, key_valid, text_len)``: the joint sequence ``(B, L + N, D)``
  (text, then the image), the time embedding ``(B, 1, D)`` (the final layer's), the shared modulation
  ``(B, 1, 6D)``, the rotary table (text at the origin, the image at its grid coordinates), ``key_valid``
  ``(B, L + N)`` bool (padded text keys False), ``text_len`` ``(1,)`` int
- the last block hands on ``(joint, temb, text_len)``
- out of the final layer: ``(prediction,)`` of the image tokens, ``(B, N, 4C)`` float32

The layers call the model's own submodules as ``Krea2Transformer2DModel.forward`` does, so a pipeline of them computes
the same function as the diffusers model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffpipe_core.parts.blocks import WrappedBlock

Tensors = tuple[torch.Tensor, ...]


def position_ids(text_len: int, h: int, w: int, device: torch.device) -> torch.Tensor:
    """``(text_len + h * w, 3)``: text at the origin, image tokens at ``(0, row, col)`` (``prepare_position_ids``)."""
    rows = torch.arange(h, device=device).repeat_interleave(w)
    cols = torch.arange(w, device=device).repeat(h)
    image = torch.stack([torch.zeros_like(rows), rows, cols], dim=1).float()
    return torch.cat([torch.zeros(text_len, 3, device=device), image])


class EmbedLayer(nn.Module):
    """Timestep embedding and the shared modulation, text fusion (layer-wise, then over the tokens with the padding
    masked) and projection, image projection, the rotary table and the key mask."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.img_in, self.time_embed, self.time_mod_proj = model.img_in, model.time_embed, model.time_mod_proj
        self.text_fusion, self.txt_in, self.rotary_emb = model.text_fusion, model.txt_in, model.rotary_emb

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, text_mask, grid = inputs
        dtype = self.img_in.bias.dtype  # the compute dtype (a quantized file's weights are stored otherwise)
        x = x.to(dtype)
        temb = self.time_embed(t, dtype=dtype)
        modulation = self.time_mod_proj(F.gelu(temb, approximate="tanh"))
        text_mask = text_mask.bool()
        txt = self.text_fusion(text.to(dtype), attention_mask=text_mask[:, None, None, :])
        txt = self.txt_in(txt)
        joint = torch.cat([txt, self.img_in(x)], dim=1)
        h, w = (int(v) for v in grid.tolist())
        cos, sin = self.rotary_emb(position_ids(txt.shape[1], h, w, joint.device))
        key_valid = torch.cat([text_mask, text_mask.new_ones(x.shape[:2])], dim=1)
        text_len = torch.tensor([txt.shape[1]], device=joint.device)
        return joint, temb, modulation, cos, sin, key_valid, text_len


class BlockLayer(WrappedBlock):
    """One single-stream block: gated GQA attention over the joint sequence (padded text keys left out), SwiGLU MLP,
    both modulated by the shared time vector plus the block's own table."""

    def forward(self, inputs: Tensors) -> Tensors:
        joint, temb, modulation, cos, sin, key_valid, text_len = inputs
        joint = self.block(joint, modulation, (cos, sin), key_valid[:, None, None, :])
        if self.last:
            return joint, temb, text_len
        return joint, temb, modulation, cos, sin, key_valid, text_len


class FinalLayer(nn.Module):
    """Final adaptive RMS norm and projection of the image tokens (the sequence after the text)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.final_layer = model.final_layer

    def forward(self, inputs: Tensors) -> Tensors:
        joint, temb, text_len = inputs
        return (self.final_layer(joint[:, int(text_len[0]) :], temb).float(),)


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``Krea2Transformer2DModel`` (sharing its parameters)."""
    blocks = list(model.transformer_blocks)
    return [EmbedLayer(model), *(BlockLayer(b, last=i == len(blocks) - 1) for i, b in enumerate(blocks)),
            FinalLayer(model)]
