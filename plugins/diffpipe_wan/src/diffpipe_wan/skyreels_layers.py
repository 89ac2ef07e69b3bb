"""SkyReels V2 cut into pipeline layers: embedders, each transformer block, the head, as
``SkyReelsV2Transformer3DModel.forward`` runs them.

What flows between layers (a tuple of tensors):

- into the first layer: ``(x, t, text[, image_embeds])`` as for Wan (:mod:`diffpipe_wan.layers`), except that ``t``
  is either ``(B,)`` (one time per sample: text- and image-to-video) or ``(B, F')`` (diffusion forcing: one time per
  latent frame, the transformer's ``enable_diffusion_forcing``);
- between blocks: ``(hidden, context, modulation, temb, rope_cos, rope_sin, grid)``; ``modulation`` is ``(B, 6, D)``
  or, per frame, ``(B, F', 6, D)`` and ``temb`` ``(B, D)`` or ``(B, F', D)``. The per-frame tensors travel per frame
  and are repeated onto each frame's tokens inside a block and the head, the very copies the forward makes once;
- the last block passes on ``(hidden, temb, grid)``; the head returns ``(prediction,)`` ``(B, C, F, h, w)``, float32.

A block attends causally by blocks of ``frames_per_block`` latent frames when that is above 1 (the transformer's
``num_frame_per_block``, or the diffusion-forcing pipeline's ``causal_block_size``), with the forward's mask.
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.parts.blocks import WrappedBlock
from diffpipe_wan import layers

Tensors = tuple[torch.Tensor, ...]
#: the transformer's ``fps`` input: 0 for 16 fps, 1 otherwise (``SkyReelsV2DiffusionForcingPipeline``)
FPS_16 = 16


def fps_index(fps: float) -> int:
    """The ``fps_embedding`` row of a frame rate, as the diffusion-forcing pipeline picks it."""
    return 0 if fps == FPS_16 else 1


def per_token(per_frame: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """``(B, F', ...)`` repeated onto the ``F' x h' x w'`` tokens: ``(B, F' h' w', ...)`` (the forward's repeat)."""
    f, h, w = (int(v) for v in grid.tolist())
    b, rest = per_frame.shape[0], per_frame.shape[2:]
    expanded = per_frame.reshape(b, f, 1, 1, *rest).expand(b, f, h, w, *rest)
    return expanded.reshape(b, f * h * w, *rest)


def causal_mask(grid: torch.Tensor, frames_per_block: int, device: torch.device) -> torch.Tensor | None:
    """The forward's block-causal attention mask ``(1, 1, N, N)`` (None for ``frames_per_block`` <= 1)."""
    if frames_per_block <= 1:
        return None
    f, h, w = (int(v) for v in grid.tolist())
    if f % frames_per_block:
        raise ValueError(
            f"SkyReels V2 attends causally in blocks of {frames_per_block} latent frames; got {f} latent frames "
            f"(use frame counts whose latent frames, (frames - 1) / 4 + 1, are a multiple of {frames_per_block})"
        )
    index = torch.arange(f // frames_per_block, device=device).repeat_interleave(frames_per_block)
    mask = (index.unsqueeze(0) <= index.unsqueeze(1)).view(f, 1, 1, f, 1, 1).expand(f, h, w, f, h, w)
    return mask.reshape(f * h * w, f * h * w)[None, None]


class EmbedLayer(layers.EmbedLayer):
    """Wan's embedders (rotary, patch, time / text / image) with SkyReels' time embedding, per sample or, for per-frame
    times ``(B, F')``, per frame (the time embedder runs on the flattened times, which it embeds one by one), and the
    frame-rate embedding of a transformer with ``inject_sample_info`` (``fps``: the clips' frame rate)."""

    def __init__(self, model: nn.Module, fps: float) -> None:
        super().__init__(model)
        self.fps_embedding = getattr(model, "fps_embedding", None)
        self.fps_projection = getattr(model, "fps_projection", None)
        self.fps = fps_index(fps)

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, *rest = inputs
        hidden, context, modulation, temb, cos, sin, grid = super().forward((x, t.flatten(), *rest))
        if t.dim() == 2:  # (B F', ...) -> (B, F', ...)
            modulation, temb = modulation.unflatten(0, t.shape), temb.unflatten(0, t.shape)
        if self.fps_embedding is not None:
            fps = torch.full((x.shape[0],), self.fps, dtype=torch.long, device=x.device)
            extra = self.fps_projection(self.fps_embedding(fps)).unflatten(1, (6, -1))
            modulation = modulation + (extra.unsqueeze(1) if t.dim() == 2 else extra)
        return hidden, context, modulation, temb, cos, sin, grid


class BlockLayer(WrappedBlock):
    """One ``SkyReelsV2TransformerBlock``: self-attention (block-causal for ``frames_per_block`` > 1) with the rotary
    embedding, cross-attention, feed-forward, modulated per sample or per frame."""

    def __init__(self, block: nn.Module, last: bool = False, frames_per_block: int = 1) -> None:
        super().__init__(block, last)
        self.frames_per_block = frames_per_block

    def forward(self, inputs: Tensors) -> Tensors:
        hidden, context, modulation, temb, cos, sin, grid = inputs
        mask = causal_mask(grid, self.frames_per_block, hidden.device)
        mod = per_token(modulation, grid).transpose(1, 2) if modulation.dim() == 4 else modulation
        hidden = self.block(hidden, context, mod, (cos, sin), mask)
        return (hidden, temb, grid) if self.last else (hidden, context, modulation, temb, cos, sin, grid)


class HeadLayer(layers.HeadLayer):
    """Wan's head (output norm modulated by ``scale_shift_table`` and the time embedding, ``proj_out``, unpatchify),
    modulated per token under diffusion forcing."""

    def shift_scale(self, temb: torch.Tensor, grid: torch.Tensor) -> Tensors:
        """Per sample as Wan's; a per-frame ``temb`` ``(B, F', D)`` repeated onto the tokens first."""
        if temb.dim() == 2:
            return super().shift_scale(temb, grid)
        table = self.scale_shift_table.unsqueeze(2) + per_token(temb, grid).unsqueeze(1)
        return tuple(part.squeeze(1) for part in table.chunk(2, dim=1))


def split_into_layers(model: nn.Module, fps: float, frames_per_block: int | None = None) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``SkyReelsV2Transformer3DModel`` (sharing its parameters);
    ``frames_per_block``: the causal block size (default: the transformer's ``num_frame_per_block``)."""
    blocks = list(model.blocks)
    if not blocks:
        raise ValueError("a SkyReels V2 transformer without blocks cannot be split into layers")
    per_block = int(frames_per_block or model.config.num_frame_per_block)
    last = len(blocks) - 1
    return [
        EmbedLayer(model, fps),
        *(BlockLayer(b, last=i == last, frames_per_block=per_block) for i, b in enumerate(blocks)),
        HeadLayer(model),
    ]
