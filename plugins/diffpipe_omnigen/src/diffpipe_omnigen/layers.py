"""OmniGen2 cut into pipeline layers (text-to-image): the embedders, each context-refiner block (caption tokens), each
noise-refiner block (image tokens; the last one joins caption and image tokens), each main block, the output head.

The first layer is OmniGen2's own: it takes ``(x_t (B, C, H, W), t (B,), text_embeds (B, L, d), text_mask (B, L))``,
``t`` OmniGen2's time (0 = noise, 1 = the image) as its pipeline hands it to the transformer, and hands on what the
core's layers of the Lumina-2 family take (:mod:`diffpipe_core.parts.refiner_layers`: the blocks, the joint sequence,
the output head negated to the flow velocity ``noise - x``).

A pipeline of these layers computes :meth:`OmniGen2Transformer2DModel.forward` without reference images (the
reference-image refiner is not trained here: see the plugin's README).
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.parts.refiner_layers import refiner_layers
from diffpipe_omnigen.model import padded, patchify, rotary, sample_ids

Tensors = tuple[torch.Tensor, ...]


class EmbedLayer(nn.Module):
    """Timestep and caption embedding, patches and their embedding, the rotary factors."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.time_caption_embed, self.x_embedder = model.time_caption_embed, model.x_embedder
        self.patch, self.rope = int(model.config.patch_size), model.rope  # rope: no parameters
        # the reference-image path, unused by text-to-image steps: held (frozen) so each stage's loading and a full
        # fine-tune's export keep the whole model
        self.ref_image_patch_embedder, self.ref_image_refiner = model.ref_image_patch_embedder, model.ref_image_refiner
        self.image_index_embedding = model.image_index_embedding
        for p in (*self.ref_image_patch_embedder.parameters(), *self.ref_image_refiner.parameters(),
                  self.image_index_embedding):
            p.requires_grad_(False)

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, text_mask = inputs
        dtype, p = self.x_embedder.weight.dtype, self.patch
        x = x.to(dtype)
        temb, cap = self.time_caption_embed(x, t.to(dtype), text.to(dtype))
        h, w = x.shape[2:]
        tables = self.rope()
        ids = [sample_ids(int(n), [], (h // p, w // p), x.device) for n in text_mask.sum(dim=1)]
        cap_freqs, _ = padded([rotary(tables, i[0]) for i in ids], text.shape[1])
        img_freqs = torch.stack([rotary(tables, i[2]) for i in ids])
        freqs, _ = padded([rotary(tables, torch.cat(i)) for i in ids])
        img = self.x_embedder(torch.stack([patchify(s, p) for s in x]))
        grid = torch.tensor([h, w], dtype=torch.long, device=x.device)
        real = torch.view_as_real
        return img, cap, temb, real(img_freqs), real(cap_freqs), real(freqs), text_mask, grid


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of an :class:`~diffpipe_omnigen.model.OmniGen2Transformer2DModel` (sharing its
    parameters): :class:`EmbedLayer`, then the core's refiner, main and output layers, the joint mask always passed
    as the reference does."""
    return refiner_layers(model, EmbedLayer(model), always_mask=True)
