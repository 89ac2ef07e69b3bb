"""Ideogram 4 cut into pipeline layers: embedders (the text features' norm and projection, the image projection, the
role embedding, the timestep's AdaLN input, the joint sequence's MRoPE table, computed once), each block, the final
layer.

What flows between layers (a tuple of tensors; every float tensor is used by a later layer):

- into the first layer: ``(x, sigma, text, text_mask, grid)``: ``x`` ``(B, N, 4C)`` the noisy latents as the
  pipeline's tokens (channel ``(2 dy + dx) * C + c``), ``sigma`` ``(B,)`` the flow time (1 = noise; the model takes
  ``1 - sigma``), ``text`` ``(B, L, 13 d)`` the tapped Qwen3-VL features with each caption's tokens at the front,
  ``text_mask`` ``(B, L)`` bool, ``grid`` ``(2,)`` int: the token grid's ``(h, w)``
- between blocks: ``(joint, adaln, cos, sin, key_valid, text_len)``: the joint sequence ``(B, L + N, D)`` (text, then
  the image), the AdaLN input ``(B, 1, adaln_dim)``, the MRoPE table, ``key_valid`` ``(B, L + N)`` bool (padded text
  keys False), ``text_len`` ``(1,)`` int
- the last block hands on ``(joint, adaln, text_len)``
- out of the final layer: ``(prediction,)`` of the image tokens, ``(B, N, 4C)`` float32: the flow velocity
  ``noise - x0``, the negative of the transformer's output (the pipeline steps with ``-v``)

The layers call the model's own submodules as ``Ideogram4Transformer2DModel.forward`` does. The pipeline lays text
out left-padded, each padding token a segment of its own that no caption token attends to; text here is at the
front, its padding keys masked: the caption and image tokens compute the same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffpipe_core.parts.blocks import WrappedBlock

Tensors = tuple[torch.Tensor, ...]


def position_ids(text_len: int, h: int, w: int, device: torch.device) -> torch.Tensor:
    """``(1, text_len + h * w, 3)``: text token ``i`` at ``(i, i, i)``, image tokens at ``IMAGE_POSITION_OFFSET +
    (0, row, col)`` (``Ideogram4Pipeline._prepare_ids`` for a caption of ``text_len`` tokens)."""
    from diffusers.models.transformers.transformer_ideogram4 import IMAGE_POSITION_OFFSET

    text = torch.arange(text_len, device=device)[:, None].expand(text_len, 3)
    rows = torch.arange(h, device=device).repeat_interleave(w)
    cols = torch.arange(w, device=device).repeat(h)
    image = torch.stack([torch.zeros_like(rows), rows, cols], dim=1) + IMAGE_POSITION_OFFSET
    return torch.cat([text, image])[None]


class EmbedLayer(nn.Module):
    """Text features (normed, projected), image tokens (projected), each with its role embedding; the timestep's
    AdaLN input; the MRoPE table and the key mask."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.input_proj, self.llm_cond_norm = model.input_proj, model.llm_cond_norm
        self.llm_cond_proj = model.llm_cond_proj
        self.t_embedding, self.adaln_proj = model.t_embedding, model.adaln_proj
        self.embed_image_indicator, self.rotary_emb = model.embed_image_indicator, model.rotary_emb

    def forward(self, inputs: Tensors) -> Tensors:
        x, sigma, text, text_mask, grid = inputs
        dtype = self.input_proj.bias.dtype  # the compute dtype (a quantized file's weights are stored otherwise)
        text_mask = text_mask.bool()
        # the pipeline's model time, 1 - timestep / 1000 in float32, handed to the transformer in its dtype
        t = (1.0 - sigma.float()).to(dtype)
        adaln = F.silu(self.adaln_proj(self.t_embedding(t).unsqueeze(1)))
        keep = text_mask.to(dtype).unsqueeze(-1)
        txt = self.llm_cond_proj(self.llm_cond_norm(text.to(dtype) * keep)) * keep
        txt = txt + self.embed_image_indicator(torch.zeros_like(text_mask, dtype=torch.long))
        img = self.input_proj(x.to(dtype)) + self.embed_image_indicator(x.new_ones(x.shape[:2], dtype=torch.long))
        joint = torch.cat([txt, img], dim=1)
        h, w = (int(v) for v in grid.tolist())
        cos, sin = self.rotary_emb(position_ids(text.shape[1], h, w, joint.device))
        key_valid = torch.cat([text_mask, text_mask.new_ones(x.shape[:2])], dim=1)
        text_len = torch.tensor([text.shape[1]], device=joint.device)
        return joint, adaln, cos.to(dtype), sin.to(dtype), key_valid, text_len


class BlockLayer(WrappedBlock):
    """One block: attention over the joint sequence (padded text keys left out) and the SwiGLU MLP, each in a
    sandwich of RMS norms, scaled and tanh-gated by the block's AdaLN modulation."""

    def forward(self, inputs: Tensors) -> Tensors:
        joint, adaln, cos, sin, key_valid, text_len = inputs
        joint = self.block(joint, key_valid[:, None, None, :], (cos, sin), adaln)
        if self.last:
            return joint, adaln, text_len
        return joint, adaln, cos, sin, key_valid, text_len


class FinalLayer(nn.Module):
    """Final norm, AdaLN scale and projection of the image tokens (the sequence after the text), negated."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.final_layer = model.final_layer

    def forward(self, inputs: Tensors) -> Tensors:
        joint, adaln, text_len = inputs
        return (-self.final_layer(joint[:, int(text_len[0]) :], adaln).float(),)


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``Ideogram4Transformer2DModel`` (sharing its parameters)."""
    blocks = list(model.layers)
    return [EmbedLayer(model), *(BlockLayer(b, last=i == len(blocks) - 1) for i, b in enumerate(blocks)),
            FinalLayer(model)]
