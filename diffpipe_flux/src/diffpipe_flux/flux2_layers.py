"""FLUX.2 cut into pipeline layers: embedders and the shared modulations, each double block, each single block, the
final norm/projection (Flux's :class:`~diffpipe_flux.layers.FinalLayer`).

What flows between layers (every float tensor is used by a later layer):

- into the first layer: ``(tokens x_t, t, text_embeds, guidance, img_ids, txt_ids)`` (ids with four axes)
- between double blocks: ``(img, txt, temb, mod_img, mod_txt, mod_single, rope_cos, rope_sin)``; the last double block
  drops the double-block modulations
- between single blocks: ``(img, txt, temb, mod_single, rope_cos, rope_sin)``; the last drops all but ``(img, temb)``
- out of the final layer: ``(prediction,)`` in float32, one token per latent patch like the input.

The layers call the model's own submodules as ``Flux2Transformer2DModel.forward`` does. A single block gets the text
and image tokens apart and joins them itself (the block's ``split_hidden_states`` path), which computes what the
forward computes on the joined stream.
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.parts.blocks import WrappedBlock
from diffpipe_flux.layers import FinalLayer, Tensors, chain


class Flux2EmbedLayer(nn.Module):
    """Image/text projections, timestep (+ guidance) embedding, the three shared modulations, rotary embedding."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.x_embedder, self.context_embedder = model.x_embedder, model.context_embedder
        self.time_guidance_embed, self.pos_embed = model.time_guidance_embed, model.pos_embed
        self.mod_img, self.mod_txt = model.double_stream_modulation_img, model.double_stream_modulation_txt
        self.mod_single = model.single_stream_modulation
        self.has_guidance = bool(model.config.guidance_embeds)

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, guidance, img_ids, txt_ids = inputs
        img = self.x_embedder(x.to(self.x_embedder.weight.dtype))
        dtype = img.dtype
        temb = self.time_guidance_embed(t.to(dtype) * 1000, guidance.to(dtype) * 1000 if self.has_guidance else None)
        txt = self.context_embedder(text.to(dtype))
        img_cos, img_sin = self.pos_embed(img_ids)
        txt_cos, txt_sin = self.pos_embed(txt_ids)
        cos, sin = torch.cat([txt_cos, img_cos]), torch.cat([txt_sin, img_sin])
        return img, txt, temb, self.mod_img(temb), self.mod_txt(temb), self.mod_single(temb), cos, sin


class Flux2DoubleBlockLayer(WrappedBlock):
    def forward(self, inputs: Tensors) -> Tensors:
        img, txt, temb, mod_img, mod_txt, mod_single, cos, sin = inputs
        txt, img = self.block(
            hidden_states=img, encoder_hidden_states=txt, temb_mod_img=mod_img, temb_mod_txt=mod_txt,
            image_rotary_emb=(cos, sin),
        )  # fmt: skip
        if self.last:
            return img, txt, temb, mod_single, cos, sin
        return img, txt, temb, mod_img, mod_txt, mod_single, cos, sin


class Flux2SingleBlockLayer(WrappedBlock):
    def forward(self, inputs: Tensors) -> Tensors:
        img, txt, temb, mod, cos, sin = inputs
        txt, img = self.block(
            hidden_states=img, encoder_hidden_states=txt, temb_mod=mod, image_rotary_emb=(cos, sin),
            split_hidden_states=True,
        )  # fmt: skip
        return (img, temb) if self.last else (img, txt, temb, mod, cos, sin)


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``Flux2Transformer2DModel`` (sharing its parameters)."""
    if not len(model.transformer_blocks):
        raise ValueError("a FLUX.2 transformer without double blocks is not supported by diffpipe-flux's layer split")
    last_double, last_single = len(model.transformer_blocks) - 1, len(model.single_transformer_blocks) - 1
    return chain(
        model,
        Flux2EmbedLayer,
        lambda b, i: Flux2DoubleBlockLayer(b, i == last_double),
        lambda b, i: Flux2SingleBlockLayer(b, i == last_single),
        FinalLayer,
    )
