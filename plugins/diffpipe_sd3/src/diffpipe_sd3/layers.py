"""diffusers' ``SD3Transformer2DModel`` cut into pipeline layers: the embedders, one layer per joint (MMDiT) block,
the output head.

What flows between layers (a tuple of tensors; every float tensor is used by the next layer):

- into the first layer: ``(x_t (B, C, H, W), t (B,), text_embeds (B, 77 + L, 4096), pooled (B, 2048))``; ``t`` is
  the flow time (1 = noise); the transformer is given ``1000 t``, the scheduler's timestep, as
  ``StableDiffusion3Pipeline`` gives it.
- through the blocks: ``(tokens, context, temb, size)``: image tokens, text tokens, the timestep-and-pooled-text
  embedding, the latent ``(H, W)`` (int). The last block (``context_pre_only``) drops the text tokens.
- out of the head: ``(velocity (B, C, H, W),)`` float32.

A pipeline of these layers computes ``SD3Transformer2DModel.forward`` (a test checks it).
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.parts.blocks import OutputHead, WrappedBlock

Tensors = tuple[torch.Tensor, ...]


class EmbedLayer(nn.Module):
    """Patch and position embedding, the timestep + pooled text embedding, the caption projection."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.pos_embed, self.time_text_embed = model.pos_embed, model.time_text_embed
        self.context_embedder = model.context_embedder

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, pooled = inputs
        dtype = self.context_embedder.weight.dtype
        size = torch.tensor(x.shape[2:], dtype=torch.long, device=x.device)
        temb = self.time_text_embed(t.float() * 1000, pooled.to(dtype))
        return self.pos_embed(x.to(dtype)), self.context_embedder(text.to(dtype)), temb, size


class JointLayer(WrappedBlock):
    """One joint block; the last (``context_pre_only``) returns no text tokens."""

    def forward(self, inputs: Tensors) -> Tensors:
        tokens, context, temb, size = inputs
        context, tokens = self.block(hidden_states=tokens, encoder_hidden_states=context, temb=temb)
        return (tokens, temb, size) if self.last else (tokens, context, temb, size)


class FinalLayer(OutputHead):
    """``(tokens, temb, size)`` -> ``(velocity,)`` in the latents' layout, float32."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.patch, self.channels = int(model.config.patch_size), int(model.out_channels)

    def forward(self, inputs: Tensors) -> Tensors:
        tokens, temb, size = inputs
        out = self.proj_out(self.norm_out(tokens, temb))
        p, (h, w) = self.patch, size.tolist()
        out = out.reshape(out.shape[0], h // p, w // p, p, p, self.channels).permute(0, 5, 1, 3, 2, 4)
        return (out.reshape(out.shape[0], self.channels, h, w).float(),)


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``SD3Transformer2DModel`` (sharing its parameters)."""
    blocks = list(model.transformer_blocks)
    if not blocks:
        raise ValueError("an SD3 transformer without joint blocks is not supported")
    return [
        EmbedLayer(model),
        *(JointLayer(b, last=i == len(blocks) - 1) for i, b in enumerate(blocks)),
        FinalLayer(model),
    ]
