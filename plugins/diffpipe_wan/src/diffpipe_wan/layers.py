"""Wan cut into pipeline layers: embedders, each transformer block, the head.

What flows between layers (a tuple of tensors; every float tensor is used downstream):

- into the first layer: ``(x, t, text[, image_embeds])``: the latents ``(B, C, F, h, w)`` (image-to-video: the noisy
  latents, the first-frame mask and the first-frame latents along the channels), the flow time ``(B,)`` in (0, 1)
  (Wan 2.2 TI2V image-to-video: one per video token, ``(B, L)``; the transformer sees ``1000 t``), the UMT5
  embeddings ``(B, L, d)`` and, for Wan 2.1 image-to-video, the CLIP vision embeddings ``(B, n, d_image)`` (first-last
  frame: both images', ``(B, 2n, d_image)``);
- between blocks: ``(hidden, context, modulation, temb, rope_cos, rope_sin, grid)``: the video tokens, the text
  (after the image) tokens, the blocks' time modulation ``(B, 6, D)`` (per token ``(B, L, 6, D)``), the time
  embedding the head uses, the rotary embedding (computed once, carried between stages) and the token grid
  ``(F', h', w')`` as an integer tensor;
- the last block passes on ``(hidden, temb, grid)``; the head returns ``(prediction,)`` ``(B, C, F, h, w)``, float32.

The layers wrap the model's own submodules and call them as ``WanTransformer3DModel.forward`` does, so chained they
compute the diffusers model.
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.parts.blocks import OutputHead, WrappedBlock

Tensors = tuple[torch.Tensor, ...]


class EmbedLayer(nn.Module):
    """Rotary embedding, patch embedding, time / text (/ image) embedders."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.rope, self.patch_embedding = model.rope, model.patch_embedding
        self.condition_embedder = model.condition_embedder
        self.patch_size = tuple(model.config.patch_size)

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, *image = inputs
        dtype = self.patch_embedding.weight.dtype
        cos, sin = self.rope(x)
        hidden = self.patch_embedding(x.to(dtype))
        grid = torch.tensor(hidden.shape[2:], dtype=torch.long)
        hidden = hidden.flatten(2).transpose(1, 2).contiguous()
        per_token = t.shape[1] if t.ndim == 2 else None  # Wan 2.2 TI2V image-to-video: a time per token
        seq_len = {} if per_token is None else {"timestep_seq_len": per_token}  # SkyReels V2's embedder takes none
        temb, modulation, context, image_context = self.condition_embedder(
            t.float().flatten() * 1000, text.to(dtype), self._image(image[0].to(dtype)) if image else None, **seq_len
        )
        if image_context is not None:
            context = torch.cat([image_context, context], dim=1)
        return hidden, context, modulation.unflatten(1 if per_token is None else 2, (6, -1)), temb, cos, sin, grid

    def _image(self, embeds: torch.Tensor) -> torch.Tensor:
        """``(B, n, d)`` image embeddings as the transformer takes them: first-last-frame models (an image embedder
        with ``pos_embed``) get each sample's two images' ``(B, 2m, d)`` as the pipeline passes them, ``(2B, m, d)``."""
        if getattr(self.condition_embedder.image_embedder, "pos_embed", None) is None:
            return embeds
        return embeds.reshape(-1, embeds.shape[1] // 2, embeds.shape[2])


class BlockLayer(WrappedBlock):
    """One ``WanTransformerBlock``: self-attention with the rotary embedding, cross-attention, feed-forward."""

    def forward(self, inputs: Tensors) -> Tensors:
        hidden, context, modulation, temb, cos, sin, grid = inputs
        hidden = self.block(hidden, context, modulation, (cos, sin))
        return (hidden, temb, grid) if self.last else (hidden, context, modulation, temb, cos, sin, grid)


class HeadLayer(OutputHead):
    """Output norm modulated by the model's ``scale_shift_table`` and the time embedding, ``proj_out``, unpatchify."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.scale_shift_table = model.scale_shift_table  # the model's own Parameter, shared
        self.patch_size = tuple(model.config.patch_size)

    def forward(self, inputs: Tensors) -> Tensors:
        hidden, temb, grid = inputs
        shift, scale = self.shift_scale(temb, grid)
        hidden = (self.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        hidden = self.proj_out(hidden)
        f, h, w = (int(v) for v in grid.tolist())
        p_t, p_h, p_w = self.patch_size
        hidden = hidden.reshape(hidden.shape[0], f, h, w, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return (hidden.flatten(6, 7).flatten(4, 5).flatten(2, 3).float(),)

    def shift_scale(self, temb: torch.Tensor, grid: torch.Tensor) -> Tensors:
        """The output norm's shift and scale from the time embedding ``(B, D)``, or per token ``(B, L, D)`` (Wan 2.2
        TI2V image-to-video)."""
        if temb.ndim == 3:
            shift, scale = (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
            return shift.squeeze(2), scale.squeeze(2)
        return (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``WanTransformer3DModel`` (sharing its parameters)."""
    blocks = list(model.blocks)
    if not blocks:
        raise ValueError("a Wan transformer without blocks cannot be split into layers")
    last = len(blocks) - 1
    return [EmbedLayer(model), *(BlockLayer(b, last=i == last) for i, b in enumerate(blocks)), HeadLayer(model)]
