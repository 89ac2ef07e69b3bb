"""LTX-Video cut into pipeline layers: embedders, each transformer block, output.

What flows between layers (a tuple of tensors; every float tensor is used downstream):

- into the first layer: ``(x_t, t, t5_embeds, t5_mask, grid)`` (see :mod:`diffpipe_ltx.inputs`), ``t`` per latent
  frame (B, F), or (B, 1) for one time on every frame;
- between blocks: ``(hidden, text, temb, embedded_timestep, rope_cos, rope_sin, t5_mask)``;
- the last block passes on only ``(hidden, embedded_timestep)``;
- out of the output layer: ``(prediction,)`` in float32, packed like ``x_t``.

The layers wrap the model's own submodules and call them exactly as ``LTXVideoTransformer3DModel.forward`` does
when ``LTXPipeline`` calls it (``num_frames/height/width`` and ``rope_interpolation_scale`` = (VAE temporal
compression / frame rate, VAE spatial compression x 2)), so a pipeline of these layers computes the diffusers model.
The time embedding is computed once per latent frame and spread over that frame's tokens; when every frame of every
sample has the same time it stays one row per sample (broadcast), as in LTXPipeline.
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.parts.blocks import OutputHead, WrappedBlock

Tensors = tuple[torch.Tensor, ...]


def frame_time_embedding(
    time_embed: nn.Module, t: torch.Tensor, tokens_per_frame: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``time_embed`` (an adaLN-single: LTX-Video's and LTX-2's video ``time_embed``) of ``1000 t`` for the times
    ``t`` (B, F) of each latent frame: ``(temb, embedded)`` with one row per sample when every frame of every sample
    has the same time (no conditioned first frame: as the pipelines pass one timestep), else one row per token (each
    frame's embedding spread over its ``tokens_per_frame`` tokens, as the image-to-video pipelines' per-token
    timesteps give). ``t`` of shape (B, 1) is one time for every frame, known from its shape without reading its
    values (sampling passes that, so a forward on the meta device, which has no values, runs too)."""
    b = t.shape[0]
    same_time = t.shape[1] == 1 or bool((t == t[:, :1]).all())  # no conditioned first frame in this micro-batch
    per_frame = t[:, :1] if same_time else t
    temb, embedded = time_embed(per_frame.flatten() * 1000, batch_size=b, hidden_dtype=dtype)
    temb, embedded = temb.view(b, per_frame.shape[1], -1), embedded.view(b, per_frame.shape[1], -1)
    if per_frame.shape[1] > 1:  # one time per frame -> one per token
        temb = temb.repeat_interleave(tokens_per_frame, dim=1)
        embedded = embedded.repeat_interleave(tokens_per_frame, dim=1)
    return temb, embedded


class EmbedLayer(nn.Module):
    """Patch projection, rotary embedding, time embedding (adaLN-single) and caption projection."""

    def __init__(self, model: nn.Module, rope_scale: tuple[float, float, float]) -> None:
        super().__init__()
        self.proj_in, self.time_embed = model.proj_in, model.time_embed
        self.caption_projection, self.rope = model.caption_projection, model.rope
        self.rope_scale = rope_scale

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, text_mask, grid = inputs
        frames, height, width = (int(v) for v in grid.tolist())
        b = x.shape[0]
        hidden = self.proj_in(x.to(self.proj_in.weight.dtype))
        dtype = hidden.dtype
        cos, sin = self.rope(hidden, frames, height, width, self.rope_scale)
        temb, embedded = frame_time_embedding(self.time_embed, t, height * width, dtype)
        text = self.caption_projection(text.to(dtype)).view(b, -1, hidden.shape[-1])
        return hidden, text, temb, embedded, cos, sin, text_mask


class BlockLayer(WrappedBlock):
    def forward(self, inputs: Tensors) -> Tensors:
        hidden, text, temb, embedded, cos, sin, text_mask = inputs
        bias = ((1 - text_mask.to(hidden.dtype)) * -10000.0).unsqueeze(1)  # as the model's forward makes it
        hidden = self.block(
            hidden_states=hidden,
            encoder_hidden_states=text,
            temb=temb,
            image_rotary_emb=(cos, sin),
            encoder_attention_mask=bias,
        )
        return (hidden, embedded) if self.last else (hidden, text, temb, embedded, cos, sin, text_mask)


class OutputLayer(OutputHead):
    """Final norm modulated by the model's ``scale_shift_table`` and the embedded timestep, then ``proj_out``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.scale_shift_table = model.scale_shift_table  # the model's own Parameter, shared

    def forward(self, inputs: Tensors) -> Tensors:
        hidden, embedded = inputs
        values = self.scale_shift_table[None, None] + embedded[:, :, None]
        shift, scale = values[:, :, 0], values[:, :, 1]
        hidden = self.norm_out(hidden) * (1 + scale) + shift
        return (self.proj_out(hidden).float(),)


def split_into_layers(model: nn.Module, rope_scale: tuple[float, float, float]) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``LTXVideoTransformer3DModel`` (sharing its parameters)."""
    blocks = list(model.transformer_blocks)
    if not blocks:
        raise ValueError("an LTX-Video transformer without transformer_blocks cannot be split into layers")
    return [
        EmbedLayer(model, rope_scale),
        *(BlockLayer(b, last=i == len(blocks) - 1) for i, b in enumerate(blocks)),
        OutputLayer(model),
    ]
