"""HunyuanVideo-1.5 cut into pipeline layers: embedders (+ the joint text sequence), each double-stream block, the
final norm/projection (HunyuanVideo 1.0's block and final layers; 1.5 has no single-stream blocks).

- into the first layer: ``(x_t, t, text_embeds, text_mask, glyph_embeds, glyph_mask[, condition, image_embeds])``:
  ``x_t`` (B, C, F, H, W); ``condition`` (B, C + 1, F, H, W) the first-frame latents and mask the pipeline puts
  beside the latents (zeros for text-to-video, when it is left out), ``image_embeds`` the SigLIP tokens.
- between blocks: ``(img_tokens, txt_tokens, temb, rope_cos, rope_sin, text_mask, grid)``, as HunyuanVideo 1.0's
  layers carry them; ``text_mask`` (bool, one entry per text token) is what the 1.5 attention processor takes.
- the last block drops what the final layer does not need: ``(img_tokens, temb, grid)``.

The text tokens are the image, glyph and Qwen tokens with each sample's valid ones first, as
``HunyuanVideo15Transformer3DModel.forward`` orders them. Text-to-video leaves out the image tokens: the model
masks them all (they are zero), so no other token sees them.
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_hunyuan.layers import DoubleBlockLayer, FinalLayer

Tensors = tuple[torch.Tensor, ...]


class EmbedLayer(nn.Module):
    """Patch, time, text (token refiner), glyph and image embeddings with their condition-type embeddings, the
    rotary embedding, and the joint text sequence with its mask."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.x_embedder, self.image_embedder = model.x_embedder, model.image_embedder
        self.context_embedder, self.context_embedder_2 = model.context_embedder, model.context_embedder_2
        self.time_embed, self.cond_type_embed, self.rope = model.time_embed, model.cond_type_embed, model.rope
        self.patch = (int(model.config.patch_size_t), int(model.config.patch_size))

    def typed(self, tokens: torch.Tensor, kind: int) -> torch.Tensor:
        """``tokens`` plus the condition-type embedding ``kind`` (0 Qwen text, 1 glyph, 2 image)."""
        return tokens + self.cond_type_embed(torch.full_like(tokens[:, :, 0], kind, dtype=torch.long))

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, text_mask, glyph, glyph_mask, *image = inputs
        dtype = self.x_embedder.proj.weight.dtype
        timestep = (t * 1000).to(dtype)  # the pipeline's scheduler timesteps are in [0, 1000]
        b, c, f, h, w = x.shape
        condition = image[0] if image else x.new_zeros(b, c + 1, f, h, w)
        hidden = torch.cat([x, condition.to(x.dtype)], dim=1).to(dtype)
        cos, sin = self.rope(hidden)
        temb = self.time_embed(timestep)
        img = self.x_embedder(hidden).contiguous()  # a transposed view; stage boundaries send contiguous
        parts = [
            self.typed(self.context_embedder_2(glyph.to(dtype)), 1),
            self.typed(self.context_embedder(text.to(dtype), timestep, text_mask), 0),
        ]
        masks = [glyph_mask.bool(), text_mask.bool()]
        if image:
            parts.insert(0, self.typed(self.image_embedder(image[1].to(dtype)), 2))
            masks.insert(0, torch.ones_like(image[1][:, :, 0], dtype=torch.bool))
        tokens, mask = torch.cat(parts, dim=1), torch.cat(masks, dim=1)
        order = torch.argsort((~mask).to(torch.uint8), dim=1, stable=True)  # each sample's valid tokens first
        mask = mask.gather(1, order)
        tokens = tokens.gather(1, order[..., None].expand_as(tokens)) * mask[..., None].to(dtype)
        pt, p = self.patch
        grid = torch.tensor([f // pt, h // p, w // p], device=img.device)
        return img, tokens, temb, cos, sin, mask, grid


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``HunyuanVideo15Transformer3DModel`` (sharing its parameters)."""
    if model.config.use_meanflow:
        raise ValueError("a HunyuanVideo-1.5 MeanFlow (super-resolution) transformer is not supported by diffpipe")
    blocks = list(model.transformer_blocks)
    return [
        EmbedLayer(model),
        *(DoubleBlockLayer(b, last=i == len(blocks) - 1) for i, b in enumerate(blocks)),
        FinalLayer(model),
    ]
