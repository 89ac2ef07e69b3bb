"""Lumina Image 2.0 cut into pipeline layers: the embedders, each context-refiner block (caption tokens), each
noise-refiner block (image tokens; the last one joins caption and image tokens), each main block, the output head.

What flows between layers (a tuple of tensors):

- into the first layer: ``(x_t (B, C, H, W), t (B,), text_embeds (B, L, d), text_mask (B, L))``; ``t`` is the flow
  time (1 = noise). The transformer itself runs on the reversed time ``1 - t`` (0 = noise), computed as
  ``Lumina2Pipeline`` computes it from the scheduler's timestep (``1 - (t * 1000) / 1000``).
- through the refiners: ``(img, cap, temb, img_freqs, cap_freqs, freqs, text_mask, grid)``: image and caption
  tokens, the timestep embedding, the rotary tables of each stream and of the joint sequence (complex numbers as
  ``(..., 2)`` floats), the caption mask and the latent size (int); the caption's table goes after the last
  context refiner (a layer hands on only what later layers use).
- through the main blocks: ``(tokens, temb, freqs, mask, lengths, grid)``: each sample's real caption tokens, then
  its image tokens, padded to the longest (``mask``: which positions exist; ``lengths``: the caption lengths).
- out of the output head: ``(velocity (B, C, H, W),)`` float32: the transformer's output negated (Lumina 2 predicts
  ``x - noise``, which ``Lumina2Pipeline`` negates before the scheduler's step), so the loss and the sampler see the
  usual flow velocity ``noise - x``.

As ``Lumina2Transformer2DModel.forward``: the caption keeps only its real tokens (the mask's count, right-padded as the
pipeline's tokenizer pads), the joint sequence is as long as the micro-batch's longest, and the attention mask is
used only when the lengths differ. A pipeline of these layers computes the same function as the diffusers model.
The first layer is Lumina 2's own; the refiner, main and output layers are the core's, shared with OmniGen2
(:mod:`diffpipe_core.parts.refiner_layers`).
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.parts.refiner_layers import refiner_layers

Tensors = tuple[torch.Tensor, ...]


class EmbedLayer(nn.Module):
    """Timestep and caption embedding, patches and their embedding, the rotary tables."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.time_caption_embed, self.x_embedder = model.time_caption_embed, model.x_embedder
        self.rope = model.rope_embedder  # no parameters: its tables are plain tensors

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, text_mask = inputs
        dtype = self.x_embedder.weight.dtype
        timestep = 1 - (t.float() * 1000) / 1000  # Lumina2Pipeline: 1 - scheduler timestep / num_train_timesteps
        x = x.to(dtype)
        temb, cap = self.time_caption_embed(x, timestep, text.to(dtype))
        patches, cap_freqs, img_freqs, freqs, _, _ = self.rope(x, text_mask)
        grid = torch.tensor(x.shape[2:], dtype=torch.long, device=x.device)
        real = torch.view_as_real
        return self.x_embedder(patches), cap, temb, real(img_freqs), real(cap_freqs), real(freqs), text_mask, grid


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``Lumina2Transformer2DModel`` (sharing its parameters):
    :class:`EmbedLayer`, then the core's refiner, main and output layers (the joint mask only when the lengths
    differ, as the diffusers forward)."""
    return refiner_layers(model, EmbedLayer(model))
