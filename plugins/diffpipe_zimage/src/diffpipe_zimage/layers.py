"""Z-Image cut into pipeline layers: embedders, each noise-refiner block (image tokens), each context-refiner block
(caption tokens; the last one joins the two streams), each main block, the final layer.

What flows between layers (a tuple of tensors; every float tensor is used by the next layer):

- into the first layer: ``(x_t (B, C, H, W), t (B,), text_embeds (B, L, d), text_mask (B, L))``; ``t`` is the flow
  time (1 = noise): the transformer itself is fed ``1 - t``, as ``ZImagePipeline`` does.
- through the refiners: ``(x, cap, adaln, x_freqs, cap_freqs, cap_mask, grid)``: image and caption tokens, the
  timestep embedding, each stream's rotary table (complex numbers as ``(..., 2)`` floats), which caption tokens
  exist (bool) and the latent grid (int).
- through the main blocks: ``(tokens, adaln, freqs, mask, grid)``, image tokens first; the last block drops
  ``freqs`` and ``mask``.
- out of the final layer: ``(velocity (B, C, H, W),)`` float32: the transformer's output negated (Z-Image predicts
  ``x - noise``), so the loss and the sampler see the usual flow velocity ``noise - x``.

A micro-batch's captions differ in length: as ``ZImageTransformer2DModel.forward`` does, each caption keeps its
real tokens, padded with ``cap_pad_token`` to a multiple of 32 (:data:`SEQ`) and placed after the image tokens;
the caption stream is as long as the micro-batch's longest padded caption (its length changes between micro-batches:
the core's pipeline engine runs with dynamic shapes), and the positions past a shorter one are hidden by the
attention mask (no mask when every caption fills it, e.g. one caption). Images of one micro-batch share a size, so
their tokens need no mask. A pipeline of these layers computes the same function as the diffusers model.
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.parts.blocks import WrappedBlock

Tensors = tuple[torch.Tensor, ...]
SEQ = 32  # ZImageTransformer2DModel pads every token sequence to a multiple of this


def _round(n: int | torch.Tensor) -> int | torch.Tensor:
    return (n + SEQ - 1) // SEQ * SEQ


def _complex(freqs: torch.Tensor) -> torch.Tensor:
    return torch.view_as_complex(freqs.contiguous())


def _attention_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """The key mask of a batch, or None when every sequence is whole (the diffusers forward passes none then)."""
    return None if bool(mask.all()) else mask


class EmbedLayer(nn.Module):
    """Timestep, patch and caption embedding, pad tokens and both streams' rotary positions."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        patch, frames = model.all_patch_size[0], model.all_f_patch_size[0]
        if frames != 1:
            raise ValueError(f"Z-Image with a frame patch size of {frames} is not supported (images use 1)")
        key = f"{patch}-{frames}"
        self.x_embedder, self.t_embedder = model.all_x_embedder[key], model.t_embedder
        self.cap_embedder = model.cap_embedder
        self.x_pad_token, self.cap_pad_token = model.x_pad_token, model.cap_pad_token
        self.rope, self.patch, self.t_scale = model.rope_embedder, int(patch), float(model.t_scale)

    def _freqs(self, ids: torch.Tensor) -> torch.Tensor:
        b, n, _ = ids.shape
        return torch.view_as_real(self.rope(ids.reshape(b * n, 3)).reshape(b, n, -1))

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, text_mask = inputs
        dtype, device = self.x_embedder.weight.dtype, x.device
        b, c, h, w = x.shape
        p = self.patch
        ht, wt = h // p, w // p
        # as ZImagePipeline computes it from the scheduler's timestep (sigma * 1000), to the last bit
        timestep = (1000 - t.float() * 1000) / 1000
        adaln = self.t_embedder(timestep * self.t_scale).to(dtype)

        # image tokens: (C, 1, H, W) patches in (f h w pf ph pw c) order, padded to a multiple of SEQ
        patches = x.to(dtype).reshape(b, c, ht, p, wt, p).permute(0, 2, 4, 3, 5, 1).reshape(b, ht * wt, p * p * c)
        n_img = ht * wt
        n_x = _round(n_img)
        img = self.x_embedder(patches)
        img = torch.cat([img, self.x_pad_token.to(img.dtype).expand(b, n_x - n_img, -1)], dim=1)

        # caption tokens: each caption's real tokens first, padded with cap_pad_token to a multiple of SEQ
        mask = text_mask.bool()
        lengths = mask.sum(dim=1)
        padded = _round(lengths)
        n_cap = int(padded.max())  # as long as the micro-batch's longest caption needs, as the diffusers forward
        order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices  # real tokens first, in order
        text = torch.gather(text, 1, order[..., None].expand_as(text))
        if n_cap > text.shape[1]:
            text = torch.cat([text, text.new_zeros(b, n_cap - text.shape[1], text.shape[2])], dim=1)
        text = text[:, :n_cap]
        cap = self.cap_embedder(text.to(dtype))
        pos = torch.arange(n_cap, device=device)[None]
        cap = torch.where((pos >= lengths[:, None])[..., None], self.cap_pad_token.to(cap.dtype), cap)
        cap_mask = pos < padded[:, None]

        # rotary positions: caption (1 + j, 0, 0); image (padded caption length + 1, row, col); padding (0, 0, 0)
        cap_ids = torch.zeros(b, n_cap, 3, dtype=torch.long, device=device)
        cap_ids[..., 0] = torch.where(cap_mask, pos + 1, 0)
        rows, cols = torch.meshgrid(torch.arange(ht, device=device), torch.arange(wt, device=device), indexing="ij")
        img_ids = torch.zeros(b, n_x, 3, dtype=torch.long, device=device)
        img_ids[:, :n_img, 0] = (padded + 1)[:, None]
        img_ids[:, :n_img, 1], img_ids[:, :n_img, 2] = rows.flatten(), cols.flatten()
        grid = torch.tensor([ht, wt], device=device)
        return img, cap, adaln, self._freqs(img_ids), self._freqs(cap_ids), cap_mask, grid


class NoiseRefinerLayer(WrappedBlock):
    """One noise-refiner block (image tokens, timestep-modulated)."""

    def forward(self, inputs: Tensors) -> Tensors:
        x, cap, adaln, x_freqs, cap_freqs, cap_mask, grid = inputs
        x = self.block(x, None, _complex(x_freqs), adaln)
        return x, cap, adaln, x_freqs, cap_freqs, cap_mask, grid


class ContextRefinerLayer(WrappedBlock):
    """One context-refiner block (caption tokens, no modulation); the last one joins image and caption tokens."""

    def forward(self, inputs: Tensors) -> Tensors:
        x, cap, adaln, x_freqs, cap_freqs, cap_mask, grid = inputs
        cap = self.block(cap, _attention_mask(cap_mask), _complex(cap_freqs))
        if not self.last:
            return x, cap, adaln, x_freqs, cap_freqs, cap_mask, grid
        tokens = torch.cat([x, cap], dim=1)
        freqs = torch.cat([x_freqs, cap_freqs], dim=1)
        mask = torch.cat([cap_mask.new_ones(x.shape[:2]), cap_mask], dim=1)
        return tokens, adaln, freqs, mask, grid


class MainLayer(WrappedBlock):
    """One main (joint) block."""

    def forward(self, inputs: Tensors) -> Tensors:
        tokens, adaln, freqs, mask, grid = inputs
        tokens = self.block(tokens, _attention_mask(mask), _complex(freqs), adaln)
        return (tokens, adaln, grid) if self.last else (tokens, adaln, freqs, mask, grid)


class FinalLayer(nn.Module):
    """The final adaLN norm and projection, un-patching, and the sign flip to the flow velocity."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        patch = model.all_patch_size[0]
        self.final = model.all_final_layer[f"{patch}-{model.all_f_patch_size[0]}"]
        self.patch, self.channels = int(patch), int(model.out_channels)

    def forward(self, inputs: Tensors) -> Tensors:
        tokens, adaln, grid = inputs
        ht, wt = grid.tolist()
        p, c = self.patch, self.channels
        out = self.final(tokens, c=adaln)[:, : ht * wt]
        out = out.reshape(out.shape[0], ht, wt, p, p, c).permute(0, 5, 1, 3, 2, 4)
        return (-out.reshape(out.shape[0], c, ht * p, wt * p).float(),)


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``ZImageTransformer2DModel`` (sharing its parameters)."""
    if getattr(model, "siglip_embedder", None) is not None:
        raise ValueError("Z-Image Omni (siglip_feat_dim set) is not supported by diffpipe-zimage; give a text-to-image "
                         "Z-Image transformer")
    contexts = list(model.context_refiner)
    mains = list(model.layers)
    if not contexts or not mains:
        raise ValueError("a Z-Image transformer without context-refiner or main blocks is not supported")
    return [
        EmbedLayer(model),
        *(NoiseRefinerLayer(b) for b in model.noise_refiner),
        *(ContextRefinerLayer(b, last=i == len(contexts) - 1) for i, b in enumerate(contexts)),
        *(MainLayer(b, last=i == len(mains) - 1) for i, b in enumerate(mains)),
        FinalLayer(model),
    ]
