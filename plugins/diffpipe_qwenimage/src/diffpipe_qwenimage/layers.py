"""Qwen-Image cut into pipeline layers: embedders, each dual-stream block, final norm/projection.

What flows between layers (a tuple of tensors; every float tensor is used by a later layer):

- into the first layer: ``(x, t, text_embeds, text_mask, shapes)``: ``x`` ``(B, N, 4C)`` the packed noisy target's
  tokens followed by those of each reference image (edit), ``t`` ``(B,)`` in [0, 1], ``text_mask`` bool, ``shapes``
  ``(K, 3)`` int ``(frames, h/2, w/2)`` of the target and of each reference image (the pipelines' ``img_shapes``)
- between blocks: ``(img, txt, temb, text_mask, shapes, img_rope, txt_rope)``, the rotary embedding computed once
  by the first layer and carried as real views of its complex tables; a ``zero_cond_t`` transformer (Edit-2511)
  also carries ``modulate_index`` ``(B, N)`` int (0: target token, 1: reference token) and a doubled ``temb``
- the last block drops the text stream, which nothing reads after it: ``(img, temb, shapes)``
- out of the final layer: ``(prediction,)`` of the target's tokens only, ``(B, h/2 * w/2, 4C)`` float32

The layers wrap the model's own submodules and call them as ``QwenImageTransformer2DModel.forward`` does, so a
pipeline of these layers computes the same function as the diffusers model (whose output the pipelines then cut
to the target's tokens).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from diffpipe_core.parts.blocks import OutputHead, WrappedBlock

Tensors = tuple[torch.Tensor, ...]


class EmbedLayer(nn.Module):
    """Image and text projections (text RMS-normed first), timestep embedding, rotary embedding."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.img_in, self.txt_norm, self.txt_in = model.img_in, model.txt_norm, model.txt_in
        self.time_text_embed, self.pos_embed = model.time_text_embed, model.pos_embed
        self.zero_cond_t = bool(model.config.zero_cond_t)

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, text_mask, shapes = inputs
        img = self.img_in(x.to(self.img_in.weight.dtype))
        timestep = t.to(img.dtype)
        sizes = [tuple(s) for s in shapes.tolist()]
        extra: Tensors = ()
        if self.zero_cond_t:  # reference tokens are modulated at t = 0
            timestep = torch.cat([timestep, timestep * 0])
            index = torch.ones(img.shape[:2], dtype=torch.int, device=img.device)
            index[:, : math.prod(sizes[0])] = 0
            extra = (index,)
        txt = self.txt_in(self.txt_norm(text.to(img.dtype)))
        temb = self.time_text_embed(timestep, img)
        img_freqs, txt_freqs = self.pos_embed([sizes], device=img.device, max_txt_seq_len=txt.shape[1])
        rope = torch.view_as_real(img_freqs), torch.view_as_real(txt_freqs)
        return (img, txt, temb, text_mask.bool(), shapes, *rope, *extra)


class BlockLayer(WrappedBlock):
    """One dual-stream block (joint attention over text and image tokens, the text padding masked)."""

    def forward(self, inputs: Tensors) -> Tensors:
        img, txt, temb, mask, shapes, img_rope, txt_rope, *extra = inputs
        rope = torch.view_as_complex(img_rope.contiguous()), torch.view_as_complex(txt_rope.contiguous())
        txt_out, img = self.block(
            hidden_states=img,
            encoder_hidden_states=txt,
            encoder_hidden_states_mask=mask,
            temb=temb,
            image_rotary_emb=rope,
            modulate_index=extra[0] if extra else None,
        )
        if self.last:
            return img, temb, shapes
        return (img, txt_out, temb, mask, shapes, img_rope, txt_rope, *extra)


class FinalLayer(OutputHead):
    """Final adaptive norm and projection, of the target's tokens."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.zero_cond_t = bool(model.config.zero_cond_t)

    def forward(self, inputs: Tensors) -> Tensors:
        img, temb, shapes = inputs
        if self.zero_cond_t:
            temb = temb.chunk(2, dim=0)[0]
        img = img[:, : math.prod(shapes[0].tolist())]
        return (self.proj_out(self.norm_out(img, temb)).float(),)


UNSUPPORTED = {
    "guidance_embeds": "a guidance-distilled Qwen-Image",
    "use_additional_t_cond": "Qwen-Image-Layered's extra time condition",
    "use_layer3d_rope": "Qwen-Image-Layered's 3D RoPE",
}


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``QwenImageTransformer2DModel`` (sharing its parameters)."""
    for key, what in UNSUPPORTED.items():
        if model.config.get(key):
            raise ValueError(
                f"transformer config {key}=True ({what}) is not supported by diffpipe-qwenimage; give a Qwen-Image "
                "or Qwen-Image-Edit transformer"
            )
    blocks = list(model.transformer_blocks)
    return [EmbedLayer(model), *(BlockLayer(b, last=i == len(blocks) - 1) for i, b in enumerate(blocks)),
            FinalLayer(model)]
