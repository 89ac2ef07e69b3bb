"""Qwen-Image 2.1 cut into pipeline layers: embedders (+ the joint sequence's RoPE and block-causal segments, computed
once), each single-stream block, the final norm/projection of the target's tokens.

What flows between layers (a tuple of tensors; every float tensor is used by a later layer):

- into the first layer: ``(x, t, text_embeds, text_mask, shapes)``: ``x`` ``(B, N, C)`` the noisy target's latent
  pixels (unpatched, row-major), ``t`` ``(B,)`` in [0, 1], ``text_mask`` bool, ``shapes`` ``(1, 3)`` int
  ``(frames, h, w)`` of the target (the pipeline's ``img_shapes``)
- between blocks: ``(joint, modulation, temb, rope, target_mask, key_valid, segments, shapes)``: the joint sequence
  ``(B, L + N, D)`` (text, then the target), the one modulation every block slices (``(B + 1, 4D)`` with
  ``causal_condition``: the last row is t = 0's, for the text), the time embedding, the rotary table as real views
  of its complex values, ``target_mask`` ``(L + N,)`` bool, ``key_valid`` ``(B, L + N)`` bool (padded text keys
  False), ``segments`` ``(K, 3)`` int ``(start, end, is_text)`` of the prefix's block-causal runs
- the last block hands on ``(joint, temb, shapes)``
- out of the final layer: ``(prediction,)`` of the target's tokens, ``(B, N, C)`` float32

The layers call the model's own submodules and helpers as ``QwenImage21Transformer2DModel.forward`` does (its
multi-pass SDPA prefill, ``QwenImage21AttnProcessor``), so a pipeline of them computes the same function as the
diffusers model, of which the pipeline keeps the target's tokens.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from diffpipe_core.parts.blocks import OutputHead, WrappedBlock

Tensors = tuple[torch.Tensor, ...]


class EmbedLayer(nn.Module):
    """Text projection (zero-centred RMS norm, MLP), image projection, timestep embedding and the shared
    modulation; the joint sequence's RoPE, target mask, key mask and block-causal segments."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.img_in, self.txt_in = model.img_in, model.txt_in
        self.time_text_embed, self.modulation, self.pos_embed = model.time_text_embed, model.modulation, model.pos_embed
        self.token_metadata = model.build_token_metadata
        self.causal = bool(model.config.causal_condition)

    def forward(self, inputs: Tensors) -> Tensors:
        from diffusers.models.transformers.transformer_qwenimage21 import _qwenimage21_prefix_segments

        x, t, text, text_mask, shapes = inputs
        img = self.img_in(x.to(self.img_in.weight.dtype))
        txt = self.txt_in(text.to(img.dtype))
        joint = torch.cat([txt, img], dim=1)
        sizes = [tuple(s) for s in shapes.tolist()]
        image_pad_mask = torch.zeros(joint.shape[1], dtype=torch.bool, device=img.device)
        image_pad_mask[txt.shape[1] :] = True
        rope = self.pos_embed(sizes, image_pad_mask, device=img.device)
        image_ids, target_mask = self.token_metadata(image_pad_mask, sizes)
        timestep = t.to(img.dtype)
        if self.causal:  # an extra t = 0 row, for the text tokens
            timestep = torch.cat([timestep, timestep.new_zeros(1)])
        temb = self.time_text_embed(timestep, img)
        key_valid = torch.ones(joint.shape[:2], dtype=torch.bool, device=img.device)
        key_valid[:, : txt.shape[1]] = text_mask.bool()
        prefix = int((~target_mask).sum())
        segments = torch.tensor(_qwenimage21_prefix_segments(image_ids, prefix), dtype=torch.long).view(-1, 3)
        return (joint, self.modulation(temb), temb, torch.view_as_real(rope), target_mask, key_valid, segments,
                shapes)


class BlockLayer(WrappedBlock):
    """One single-stream block: block-causal attention over the joint sequence (text causal, each image block
    bidirectional; padded text keys left out), gated SwiGLU MLP."""

    def __init__(self, block: nn.Module, causal: bool, last: bool = False) -> None:
        super().__init__(block, last)
        self.causal = causal

    def forward(self, inputs: Tensors) -> Tensors:
        joint, modulation, temb, rope, target_mask, key_valid, segments, shapes = inputs
        joint = self.block(
            hidden_states=joint,
            modulation=modulation,
            rotary_emb=torch.view_as_complex(rope.contiguous()),
            target_token_mask=target_mask if self.causal else None,
            segments=[(start, end, bool(text)) for start, end, text in segments.tolist()],
            key_valid=None if bool(key_valid.all()) else key_valid,
        )
        if self.last:
            return joint, temb, shapes
        return joint, modulation, temb, rope, target_mask, key_valid, segments, shapes


class FinalLayer(OutputHead):
    """Final scale-only adaptive norm and projection of the target's tokens (the sequence's last ``h * w``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.causal = bool(model.config.causal_condition)

    def forward(self, inputs: Tensors) -> Tensors:
        joint, temb, shapes = inputs
        n = math.prod(shapes[-1].tolist())
        target = joint[:, -n:]
        rows = torch.ones(n, dtype=torch.bool, device=joint.device) if self.causal else None
        return (self.proj_out(self.norm_out(target, temb, rows)).float(),)


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``QwenImage21Transformer2DModel`` (sharing its parameters)."""
    if model.config.patch_size != 1:
        raise ValueError(
            f"transformer config patch_size={model.config.patch_size}: diffpipe-qwenimage trains Qwen-Image 2.1's "
            "unpatched transformer (patch_size 1) only"
        )
    causal = bool(model.config.causal_condition)
    blocks = list(model.transformer_blocks)
    return [EmbedLayer(model), *(BlockLayer(b, causal, last=i == len(blocks) - 1) for i, b in enumerate(blocks)),
            FinalLayer(model)]
