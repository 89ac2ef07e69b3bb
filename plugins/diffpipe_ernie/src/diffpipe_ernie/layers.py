"""ERNIE-Image cut into pipeline layers: the embedders, each shared-adaLN block, the final layer.

What flows between layers (a tuple of tensors):

- into the first layer: ``(x_t (B, C, h, w), t (B,), text (B, L, d), text_mask (B, L))``: the patchified,
  normalised latents, the flow time (1 = noise; the transformer is fed ``1000 t``, the scheduler's timestep, as
  ``ErnieImagePipeline`` does) and each caption's tokens first, zero-padded (``text_mask``).
- through the blocks: ``(x (S, B, D), rope (B, S, 1, head_dim), mask (B, 1, 1, S), c (B, D), modulation (B, 6 D),
  grid)``: image tokens then text tokens, sequence first as the model keeps them; the rotary angles; which tokens
  exist (bool: a shorter caption's padding is hidden); the timestep embedding; the shared adaLN modulation (one
  linear for every block); the latent grid (int). The last block hands on only ``(x, c, grid)``.
- out of the final layer: ``(velocity (B, C, h, w),)`` float32: the transformer's output, which the pipeline's Euler
  scheduler takes as the flow velocity ``noise - x``.

A pipeline of these layers computes ``ErnieImageTransformer2DModel.forward`` exactly, for captions of different
lengths in one micro-batch (the forward's ``text_lens``).
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.parts.blocks import WrappedBlock

Tensors = tuple[torch.Tensor, ...]


class EmbedLayer(nn.Module):
    """Patch, text and timestep embedding, the shared adaLN modulation, rotary angles and the attention mask."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if model.patch_size != 1:
            raise ValueError(f"ERNIE-Image with patch_size {model.patch_size} is not supported (the release uses 1)")
        self.x_embedder, self.text_proj = model.x_embedder, model.text_proj
        self.time_proj, self.time_embedding = model.time_proj, model.time_embedding
        self.pos_embed, self.adaLN_modulation = model.pos_embed, model.adaLN_modulation
        self.head_dim = int(sum(model.pos_embed.axes_dim))

    def _rope(self, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The rotary angles of ``ids`` ``(B, S, 3)``; on the meta device (the activation estimate) only their shape:
        the diffusers embedding disables autocast for its device type, which meta has not."""
        if like.is_meta:
            return torch.empty(*ids.shape[:2], 1, self.head_dim, device="meta")
        return self.pos_embed(ids)

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, text_mask = inputs
        dtype = self.x_embedder.proj.weight.dtype
        b, _, h, w = x.shape
        device = text_mask.device  # x's, but for the activation estimate, where the integers stay real
        img = self.x_embedder(x.to(dtype)).transpose(0, 1)
        text = text.to(dtype)
        if self.text_proj is not None and text.numel() > 0:
            text = self.text_proj(text)
        tokens = torch.cat([img, text.transpose(0, 1)], dim=0).contiguous()

        lengths = text_mask.long().sum(dim=1)
        n = text.shape[1]
        text_ids = torch.zeros(b, n, 3, device=device)
        text_ids[..., 0] = torch.arange(n, device=device, dtype=torch.float32)
        rows, cols = torch.meshgrid(torch.arange(h, device=device, dtype=torch.float32),
                                    torch.arange(w, device=device, dtype=torch.float32), indexing="ij")
        image_ids = torch.stack([rows.flatten(), cols.flatten()], dim=-1).expand(b, -1, -1)
        image_ids = torch.cat([lengths.float().view(b, 1, 1).expand(-1, h * w, -1), image_ids], dim=-1)
        rope = self._rope(torch.cat([image_ids, text_ids], dim=1), x)

        valid = torch.arange(n, device=device).view(1, n) < lengths.view(b, 1)
        mask = torch.cat([torch.ones(b, h * w, device=device, dtype=torch.bool), valid], dim=1)[:, None, None, :]
        mask = mask.to(x.device)

        timestep = t.float() * 1000  # the scheduler's timestep, sigma * num_train_timesteps
        c = self.time_embedding(self.time_proj(timestep).to(dtype))
        return tokens, rope, mask, c, self.adaLN_modulation(c), torch.tensor([h, w], device=device)


class BlockLayer(WrappedBlock):
    """One shared-adaLN block (the modulation spread over the sequence, as the forward does)."""

    def forward(self, inputs: Tensors) -> Tensors:
        x, rope, mask, c, modulation, grid = inputs
        temb = [m.unsqueeze(0).expand(x.shape[0], -1, -1) for m in modulation.chunk(6, dim=-1)]
        x = self.block(x, rope, temb, mask)
        return (x, c, grid) if self.last else (x, rope, mask, c, modulation, grid)


class FinalLayer(nn.Module):
    """The final adaLN norm and projection of the image tokens, back to ``(B, C, h, w)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.final_norm, self.final_linear = model.final_norm, model.final_linear
        self.channels = int(model.out_channels)

    def forward(self, inputs: Tensors) -> Tensors:
        x, c, grid = inputs
        h, w = grid.tolist()
        x = self.final_norm(x, c).type_as(x)
        patches = self.final_linear(x)[: h * w].transpose(0, 1)
        return (patches.reshape(patches.shape[0], h, w, self.channels).permute(0, 3, 1, 2).float(),)


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``ErnieImageTransformer2DModel`` (sharing its parameters)."""
    blocks = list(model.layers)
    if not blocks:
        raise ValueError("an ERNIE-Image transformer without blocks (num_layers = 0) is not supported")
    return [EmbedLayer(model), *(BlockLayer(b, last=i == len(blocks) - 1) for i, b in enumerate(blocks)),
            FinalLayer(model)]
