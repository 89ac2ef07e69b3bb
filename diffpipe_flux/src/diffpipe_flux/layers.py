"""Flux cut into pipeline layers: embedders, each double block, each single block, final norm/projection.

What flows between layers (a tuple of tensors; every float tensor is used by the next layer):

- into the first layer: ``(packed x_t, t, t5_embeds, clip_pooled, guidance, img_ids, txt_ids)``
- between blocks: ``(img_tokens, txt_tokens, temb, rope_cos, rope_sin)``
- the last single block drops what the final layer does not need: ``(img_tokens, temb)``
- out of the final layer: ``(prediction,)`` in float32, packed like the input.

The layers wrap the model's own submodules and call them exactly as ``FluxTransformer2DModel.forward``
does, so a pipeline of these layers computes the same function as the diffusers model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from diffpipe_core.parts.blocks import OutputHead, WrappedBlock

Tensors = tuple[torch.Tensor, ...]


class EmbedLayer(nn.Module):
    """Image/text projections, timestep (+ guidance) and pooled-text embedding, rotary embedding."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.x_embedder, self.context_embedder = model.x_embedder, model.context_embedder
        self.time_text_embed, self.pos_embed = model.time_text_embed, model.pos_embed
        self.has_guidance = bool(model.config.guidance_embeds)

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, pooled, guidance, img_ids, txt_ids = inputs
        img = self.x_embedder(x.to(self.x_embedder.weight.dtype))
        dtype = img.dtype
        timestep = t.to(dtype) * 1000
        if self.has_guidance:
            temb = self.time_text_embed(timestep, guidance.to(dtype) * 1000, pooled.to(dtype))
        else:
            temb = self.time_text_embed(timestep, pooled.to(dtype))
        txt = self.context_embedder(text.to(dtype))
        cos, sin = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        return img, txt, temb, cos, sin


class DoubleBlockLayer(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: Tensors) -> Tensors:
        img, txt, temb, cos, sin = inputs
        txt, img = self.block(hidden_states=img, encoder_hidden_states=txt, temb=temb, image_rotary_emb=(cos, sin))
        return img, txt, temb, cos, sin


class SingleBlockLayer(WrappedBlock):
    def forward(self, inputs: Tensors) -> Tensors:
        img, txt, temb, cos, sin = inputs
        txt, img = self.block(hidden_states=img, encoder_hidden_states=txt, temb=temb, image_rotary_emb=(cos, sin))
        return (img, temb) if self.last else (img, txt, temb, cos, sin)


class FinalLayer(OutputHead):
    def forward(self, inputs: Tensors) -> Tensors:
        img, temb = inputs
        return (self.proj_out(self.norm_out(img, temb)).float(),)


def chain(
    model: nn.Module,
    embed: Callable[[nn.Module], nn.Module],
    double: Callable[[nn.Module, int], nn.Module],
    single: Callable[[nn.Module, int], nn.Module],
    final: Callable[[nn.Module], nn.Module] = FinalLayer,
) -> list[nn.Module]:
    """The layers of a Flux-family transformer: ``embed(model)``, ``double(block, i)`` for each double block,
    ``single(block, i)`` for each single block (the last returns what ``final`` takes), ``final(model)``."""
    singles = list(model.single_transformer_blocks)
    if not singles:
        raise ValueError("a Flux transformer without single blocks is not supported by diffpipe-flux's layer split")
    doubles = list(model.transformer_blocks)
    return [
        embed(model),
        *(double(b, i) for i, b in enumerate(doubles)),
        *(single(b, i) for i, b in enumerate(singles)),
        final(model),
    ]


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``FluxTransformer2DModel`` (sharing its parameters)."""
    last = len(model.single_transformer_blocks) - 1
    return chain(model, EmbedLayer, lambda b, i: DoubleBlockLayer(b), lambda b, i: SingleBlockLayer(b, i == last))
