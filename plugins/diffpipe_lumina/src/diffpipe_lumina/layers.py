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
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.parts.blocks import WrappedBlock

Tensors = tuple[torch.Tensor, ...]


def _complex(freqs: torch.Tensor) -> torch.Tensor:
    return torch.view_as_complex(freqs.contiguous())


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


class ContextRefinerLayer(WrappedBlock):
    """One context-refiner block (caption tokens, no modulation, the caption mask); the last one drops the caption's
    rotary table."""

    def forward(self, inputs: Tensors) -> Tensors:
        img, cap, temb, img_freqs, cap_freqs, freqs, text_mask, grid = inputs
        cap = self.block(cap, text_mask, _complex(cap_freqs))
        if self.last:
            return img, cap, temb, img_freqs, freqs, text_mask, grid
        return img, cap, temb, img_freqs, cap_freqs, freqs, text_mask, grid


class NoiseRefinerLayer(WrappedBlock):
    """One noise-refiner block (image tokens, timestep-modulated); the last one joins each sample's real caption
    tokens and its image tokens into one sequence."""

    def forward(self, inputs: Tensors) -> Tensors:
        img, cap, temb, img_freqs, freqs, text_mask, grid = inputs
        img = self.block(img, None, _complex(img_freqs), temb)
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
    """One main block over the joint sequence (the mask only when the samples' lengths differ, as the forward)."""

    def forward(self, inputs: Tensors) -> Tensors:
        tokens, temb, freqs, mask, lengths, grid = inputs
        tokens = self.block(tokens, None if bool(mask.all()) else mask, _complex(freqs), temb)
        return (tokens, temb, lengths, grid) if self.last else (tokens, temb, freqs, mask, lengths, grid)


class FinalLayer(nn.Module):
    """The output norm and projection, each sample's image tokens un-patched, the sign flip to the flow velocity."""

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


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``Lumina2Transformer2DModel`` (sharing its parameters)."""
    contexts, noises, mains = list(model.context_refiner), list(model.noise_refiner), list(model.layers)
    if not contexts or not noises or not mains:
        raise ValueError("a Lumina 2 transformer without refiner or main blocks is not supported "
                         f"(num_refiner_layers = {len(noises)}, num_layers = {len(mains)})")
    return [
        EmbedLayer(model),
        *(ContextRefinerLayer(b, last=i == len(contexts) - 1) for i, b in enumerate(contexts)),
        *(NoiseRefinerLayer(b, last=i == len(noises) - 1) for i, b in enumerate(noises)),
        *(MainLayer(b, last=i == len(mains) - 1) for i, b in enumerate(mains)),
        FinalLayer(model),
    ]
