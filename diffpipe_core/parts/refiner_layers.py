"""Pipeline layers of a Lumina-2 style single-stream DiT (Lumina Image 2.0, OmniGen2): caption refiner blocks, noise
refiner blocks over the image tokens (the last one joins each sample's real caption tokens and its image tokens into
one sequence), main blocks over that sequence, and the output head. The blocks are diffusers'
``Lumina2TransformerBlock`` (``block(x, mask, freqs, temb)``); a plugin writes its own first layer (embedders and
rotary factors) and uses these for the rest.

What flows between layers (a tuple of tensors):

- through the refiners: ``(img, cap, temb, img_freqs, cap_freqs, freqs, text_mask, grid)``: image and caption tokens,
  the timestep embedding, the rotary factors of each stream and of the joint sequence (complex numbers as ``(..., 2)``
  floats), the caption mask and the latent size (int); the caption's factors go after the last context refiner.
- through the main blocks: ``(tokens, temb, freqs, mask, lengths, grid)``: each sample's real caption tokens, then its
  image tokens, padded to the longest (``mask``: which positions exist; ``lengths``: the caption lengths).
- out of the output head: ``(velocity (B, C, H, W),)`` float32: the model's output un-patched and negated (these
  models predict ``x - noise``), so the loss and the sampler see the usual flow velocity ``noise - x``.
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.parts.blocks import WrappedBlock

Tensors = tuple[torch.Tensor, ...]


def as_complex(freqs: torch.Tensor) -> torch.Tensor:
    """Rotary factors carried as ``(..., 2)`` floats, back to complex numbers."""
    return torch.view_as_complex(freqs.contiguous())


class ContextRefinerLayer(WrappedBlock):
    """One context-refiner block (caption tokens, no modulation, the caption mask); the last one drops the caption's
    rotary factors."""

    def forward(self, inputs: Tensors) -> Tensors:
        img, cap, temb, img_freqs, cap_freqs, freqs, text_mask, grid = inputs
        cap = self.block(cap, text_mask.bool(), as_complex(cap_freqs))
        if self.last:
            return img, cap, temb, img_freqs, freqs, text_mask, grid
        return img, cap, temb, img_freqs, cap_freqs, freqs, text_mask, grid


class NoiseRefinerLayer(WrappedBlock):
    """One noise-refiner block (image tokens, timestep-modulated); the last one joins each sample's real caption
    tokens and its image tokens into one sequence, padded to the longest."""

    def forward(self, inputs: Tensors) -> Tensors:
        img, cap, temb, img_freqs, freqs, text_mask, grid = inputs
        img = self.block(img, None, as_complex(img_freqs), temb)
        if not self.last:
            return img, cap, temb, img_freqs, freqs, text_mask, grid
        lengths = text_mask.sum(dim=1).long()
        n_img = img.shape[1]
        longest = int(lengths.max()) + n_img
        tokens = img.new_zeros(img.shape[0], longest, img.shape[2])
        mask = torch.zeros(img.shape[0], longest, dtype=torch.bool, device=img.device)
        for i, n in enumerate(lengths.tolist()):
            mask[i, : n + n_img] = True
            tokens[i, :n] = cap[i, :n]
            tokens[i, n : n + n_img] = img[i]
        return tokens, temb, freqs, mask, lengths, grid


class MainLayer(WrappedBlock):
    """One main block over the joint sequence. ``always_mask``: pass the joint mask even when every sample's sequence
    is as long as the longest (OmniGen2's reference does); else only when the lengths differ (diffusers' Lumina 2)."""

    def __init__(self, block: nn.Module, last: bool = False, always_mask: bool = False) -> None:
        super().__init__(block, last)
        self.always_mask = always_mask

    def forward(self, inputs: Tensors) -> Tensors:
        tokens, temb, freqs, mask, lengths, grid = inputs
        attention_mask = mask if self.always_mask or not bool(mask.all()) else None
        tokens = self.block(tokens, attention_mask, as_complex(freqs), temb)
        return (tokens, temb, lengths, grid) if self.last else (tokens, temb, freqs, mask, lengths, grid)


class FinalLayer(nn.Module):
    """The output norm and projection, each sample's image tokens un-patched (patches row by row, each ``(p1, p2, c)``
    flattened), the sign flip to the flow velocity."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.norm_out = model.norm_out
        self.patch, self.channels = int(model.config.patch_size), int(model.out_channels)

    def forward(self, inputs: Tensors) -> Tensors:
        tokens, temb, lengths, grid = inputs
        tokens = self.norm_out(tokens, temb)
        p, c = self.patch, self.channels
        h, w = grid.tolist()
        n_img = (h // p) * (w // p)
        out = torch.stack([tokens[i, n : n + n_img] for i, n in enumerate(lengths.tolist())])
        out = out.reshape(out.shape[0], h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4)
        return (-out.reshape(out.shape[0], c, h, w).float(),)


def refiner_layers(model: nn.Module, first: nn.Module, always_mask: bool = False) -> list[nn.Module]:
    """``first`` (the plugin's embedding layer), then a layer per block of ``model.context_refiner``,
    ``model.noise_refiner`` and ``model.layers``, then the output head; a model without one of the three kinds is
    refused, naming the counts."""
    contexts, noises, mains = list(model.context_refiner), list(model.noise_refiner), list(model.layers)
    if not contexts or not noises or not mains:
        raise ValueError(f"a {type(model).__name__} without refiner or main blocks is not supported "
                         f"(num_refiner_layers = {len(noises)}, num_layers = {len(mains)})")
    return [
        first,
        *(ContextRefinerLayer(b, last=i == len(contexts) - 1) for i, b in enumerate(contexts)),
        *(NoiseRefinerLayer(b, last=i == len(noises) - 1) for i, b in enumerate(noises)),
        *(MainLayer(b, last=i == len(mains) - 1, always_mask=always_mask) for i, b in enumerate(mains)),
        FinalLayer(model),
    ]
