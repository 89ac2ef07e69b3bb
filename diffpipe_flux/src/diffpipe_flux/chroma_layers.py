"""Chroma cut into pipeline layers: embedders and the modulation approximator, each double block, each single block,
the final norm/projection (Flux's :class:`~diffpipe_flux.layers.FinalLayer`).

What flows between layers (every float tensor is used by a later layer):

- into the first layer: ``(packed x_t, t, t5_embeds, t5_mask, img_ids, txt_ids)``; ``t5_mask`` (long) keeps each
  caption's tokens and its first padding token, as ``ChromaPipeline`` masks them
- between blocks: ``(img, txt, modulations, rope_cos, rope_sin, mask)``: ``modulations`` holds every block's
  shift/scale/gate vectors (the approximator's output), ``mask`` (long) the text mask extended over the image
- the last single block gives ``(img, final modulations)``; out of the final layer ``(prediction,)`` in float32.

The layers call the model's own submodules as ``ChromaTransformer2DModel.forward`` does: each block takes its slice of
the modulations, and the attention mask in the activations' dtype (``ChromaPipeline`` hands the transformer a float
0/1 mask, which the blocks turn into a pairwise one and the attention adds to its scores). A single block gets the
text and image tokens apart and joins them itself, which computes what the forward computes on the joined stream.
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_flux.layers import FinalLayer, Tensors, chain


class ChromaEmbedLayer(nn.Module):
    """Image/text projections, the approximator's modulations from the timestep, rotary embedding, the joint mask."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.x_embedder, self.context_embedder = model.x_embedder, model.context_embedder
        self.time_text_embed, self.pos_embed = model.time_text_embed, model.pos_embed
        self.distilled_guidance_layer = model.distilled_guidance_layer

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, text_mask, img_ids, txt_ids = inputs
        img = self.x_embedder(x.to(self.x_embedder.weight.dtype))
        dtype = img.dtype
        modulations = self.distilled_guidance_layer(self.time_text_embed(t.to(dtype) * 1000))
        txt = self.context_embedder(text.to(dtype))
        cos, sin = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        mask = torch.cat([text_mask.long(), text_mask.new_ones(text_mask.shape[0], img.shape[1]).long()], dim=1)
        return img, txt, modulations, cos, sin, mask


class ChromaDoubleBlockLayer(nn.Module):
    def __init__(self, block: nn.Module, index: int, n_double: int, n_single: int) -> None:
        super().__init__()
        self.block = block
        self.img_mod = 3 * n_single + 6 * index
        self.txt_mod = 3 * n_single + 6 * n_double + 6 * index

    def forward(self, inputs: Tensors) -> Tensors:
        img, txt, mods, cos, sin, mask = inputs
        temb = torch.cat((mods[:, self.img_mod : self.img_mod + 6], mods[:, self.txt_mod : self.txt_mod + 6]), dim=1)
        txt, img = self.block(
            hidden_states=img, encoder_hidden_states=txt, temb=temb, image_rotary_emb=(cos, sin),
            attention_mask=mask.to(img.dtype),
        )  # fmt: skip
        return img, txt, mods, cos, sin, mask


class ChromaSingleBlockLayer(nn.Module):
    def __init__(self, block: nn.Module, index: int, last: bool) -> None:
        super().__init__()
        self.block, self.mod, self.last = block, 3 * index, last

    def forward(self, inputs: Tensors) -> Tensors:
        img, txt, mods, cos, sin, mask = inputs
        out = self.block(
            hidden_states=torch.cat([txt, img], dim=1), temb=mods[:, self.mod : self.mod + 3],
            image_rotary_emb=(cos, sin), attention_mask=mask.to(img.dtype),
        )  # fmt: skip
        txt, img = out[:, : txt.shape[1]], out[:, txt.shape[1] :]
        return (img, mods[:, -2:]) if self.last else (img, txt, mods, cos, sin, mask)


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``ChromaTransformer2DModel`` (sharing its parameters)."""
    n_double, n_single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    return chain(
        model,
        ChromaEmbedLayer,
        lambda b, i: ChromaDoubleBlockLayer(b, i, n_double, n_single),
        lambda b, i: ChromaSingleBlockLayer(b, i, i == n_single - 1),
        FinalLayer,
    )
