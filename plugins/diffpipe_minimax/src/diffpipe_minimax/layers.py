"""MiniMax H3 cut into pipeline layers: the embedders (with the text refiner), each block, the output head.

MiniMax H3 runs one stack of blocks over one packed sequence ``[text | audio | video]`` (the pipeline's ``t2va``
layout, :func:`diffpipe_minimax.packing.layout`); its AdaLN table holds one row per (noise level, modality).
What flows between layers (a tuple of tensors):

- into the first layer: ``(video (B, Nv, C p), audio (B, Na, Ca), timestep (B, T), timestep_indices (S,),
  token_tags (S,), position_ids (S, 3), text (B, L, d), text_mask (B, L), video_indices (Nv,),
  audio_indices (Na,))``: the patchified video rows and the audio rows, each item's distinct times in the model's
  convention (``1 - sigma``, 1 = clean), which of them every row takes, the rows' modality tags (0 video, 1 text,
  2 audio), the rows' rotary coordinates, each caption's tokens first and zero-padded, and where the video and
  audio rows sit in the sequence.
- through the blocks: ``(x (B, S, D), temb (B, T, E), cos, sin, adaln_indices (S,), key_mask (B, S),
  timestep_indices, video_indices, audio_indices)``; the last block hands on no rotary angles.
- out of the head: ``(velocity (B, Nv C p + Na Ca),)`` float32, the model's data-ward velocities of the video rows
  then the audio rows, flattened side by side (:func:`join`; one tensor, as the sampler steps the first output).

The batch of ``MiniMaxH3Transformer3DModel.forward`` only repeats one layout at one set of times; here every item
has its own times and caption, so the blocks and the head run item by item (one call at batch size 1, the usual
micro-batch of a video model), and a caption shorter than the micro-batch's longest is refined alone and hidden
from attention (``key_mask``). At batch size 1 the layers compute the forward exactly.
"""

from __future__ import annotations

import torch
from diffusers.models.modeling_utils import get_parameter_dtype
from torch import nn

from diffpipe_core.parts.blocks import OutputHead, WrappedBlock

Tensors = tuple[torch.Tensor, ...]
#: rows of the AdaLN table per noise level: video, text, audio (``MINIMAX_H3_MODALITY_NUM``)
MODALITIES = 3


class EmbedLayer(nn.Module):
    """The video, audio and text projections (the text through the token refiner), the time embedding of each
    item's times, the rotary angles and the packed sequence."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.proj_in, self.audio_proj_in = model.proj_in, model.audio_proj_in
        self.context_embedder, self.token_refiner = model.context_embedder, model.token_refiner
        self.time_proj, self.time_embedder, self.rope = model.time_proj, model.time_embedder, model.rope

    def refined_text(self, text: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        """Each caption's own tokens through the projection and the refiner (which has no mask), zeros after them."""
        embeds = self.context_embedder(text.to(get_parameter_dtype(self.context_embedder)))
        lengths = [embeds.shape[1]] * embeds.shape[0] if text_mask.is_meta else text_mask.sum(dim=1).tolist()
        if all(n == embeds.shape[1] for n in lengths):
            return self.token_refiner(embeds)
        rows = []
        for row, n in enumerate(lengths):
            kept = self.token_refiner(embeds[row : row + 1, :n]) if n else embeds[row : row + 1, :0]
            rows.append(torch.cat([kept, embeds.new_zeros(1, embeds.shape[1] - n, embeds.shape[2])], dim=1))
        return torch.cat(rows)

    def forward(self, inputs: Tensors) -> Tensors:
        video, audio, timestep, timestep_indices, token_tags, position_ids, text, text_mask, vidx, aidx = inputs
        cos, sin = self.rope(position_ids)
        text = self.refined_text(text, text_mask)
        b, n = text.shape[:2]
        x = text.new_zeros(b, position_ids.shape[0], text.shape[-1])
        x = x.index_copy(1, torch.arange(n, device=vidx.device), text)
        video = self.proj_in(video.to(get_parameter_dtype(self.proj_in)))
        audio = self.audio_proj_in(audio.to(get_parameter_dtype(self.audio_proj_in)))
        x = x.index_copy(1, vidx, video.to(text.dtype)).index_copy(1, aidx, audio.to(text.dtype))
        temb = self.time_proj(timestep.flatten())
        temb = self.time_embedder(temb.to(get_parameter_dtype(self.time_embedder))).view(b, timestep.shape[1], -1)
        key_mask = torch.ones(b, position_ids.shape[0], dtype=torch.bool, device=text_mask.device)
        key_mask[:, :n] = text_mask.bool()
        adaln_indices = timestep_indices * MODALITIES + token_tags
        return x, temb, cos, sin, adaln_indices, key_mask, timestep_indices, vidx, aidx


class BlockLayer(WrappedBlock):
    """One ``MiniMaxH3TransformerBlock``, item by item (each at its own times); padded caption rows are hidden."""

    def forward(self, inputs: Tensors) -> Tensors:
        x, temb, cos, sin, adaln_indices, key_mask, timestep_indices, vidx, aidx = inputs
        masked = not key_mask.is_meta and not bool(key_mask.all())
        rows = []
        for row in range(x.shape[0]):
            mask = key_mask[row].view(1, 1, 1, -1) if masked else None
            rows.append(self.block(x[row : row + 1], temb[row], adaln_indices, (cos, sin), mask))
        x = torch.cat(rows) if len(rows) > 1 else rows[0]
        if self.last:
            return x, temb, timestep_indices, vidx, aidx
        return x, temb, cos, sin, adaln_indices, key_mask, timestep_indices, vidx, aidx


class HeadLayer(OutputHead):
    """The row-modulated output norm, then the video and audio heads over their rows (float32, as the model keeps
    them)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.audio_proj_out = model.audio_proj_out

    def forward(self, inputs: Tensors) -> Tensors:
        x, temb, timestep_indices, vidx, aidx = inputs
        rows = [self.norm_out(x[row : row + 1], temb[row], timestep_indices) for row in range(x.shape[0])]
        x = (torch.cat(rows) if len(rows) > 1 else rows[0]).to(get_parameter_dtype(self.proj_out))
        video = self.proj_out(x).index_select(1, vidx)
        audio = self.audio_proj_out(x).index_select(1, aidx)
        return (join(video.float(), audio.float()),)


def join(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
    """Video rows ``(B, Nv, C p)`` and audio rows ``(B, Na, Ca)`` flattened side by side: ``(B, Nv C p + Na Ca)``."""
    return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)


def split(joined: torch.Tensor, video_shape: tuple[int, int], audio_shape: tuple[int, int]) -> Tensors:
    """Inverse of :func:`join`: the video rows ``(B, *video_shape)`` and the audio rows ``(B, *audio_shape)``."""
    b, cut = joined.shape[0], video_shape[0] * video_shape[1]
    return joined[:, :cut].reshape(b, *video_shape), joined[:, cut:].reshape(b, *audio_shape)


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``MiniMaxH3Transformer3DModel`` (sharing its parameters)."""
    blocks = list(model.transformer_blocks)
    if not blocks:
        raise ValueError("a MiniMax H3 transformer without blocks (num_layers = 0) is not supported")
    return [EmbedLayer(model), *(BlockLayer(b, last=i == len(blocks) - 1) for i, b in enumerate(blocks)),
            HeadLayer(model)]
