"""The reference model cut into pipeline layers (imported by ``split_into_layers`` when it is called)."""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_reference.model import TinyDiT


class EmbedLayer(nn.Module):
    def __init__(self, model: TinyDiT) -> None:
        super().__init__()
        self.x_embedder, self.t_embedder = model.x_embedder, model.t_embedder
        self.text_proj, self.pooled_proj = model.text_proj, model.pooled_proj
        self._embed = TinyDiT.embed.__get__(self)
        self.config = model.config

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, t, text = inputs
        dtype = self.x_embedder.weight.dtype
        tokens, c = self._embed(x.to(dtype), t, text.to(dtype))
        hw = torch.tensor(x.shape[2:], dtype=torch.long, device=x.device)
        return tokens, c, hw


class BlockLayer(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        tokens, c, hw = inputs
        return self.block(tokens, c), c, hw


class FinalLayer(nn.Module):
    def __init__(self, model: TinyDiT) -> None:
        super().__init__()
        self.norm_out, self.final_modulation, self.proj_out = model.norm_out, model.final_modulation, model.proj_out
        self._unembed = TinyDiT.unembed.__get__(self)
        self.config = model.config

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        tokens, c, hw = inputs
        return (self._unembed(tokens, c, int(hw[0]), int(hw[1])).float(),)


def split_into_layers(model: TinyDiT) -> list[nn.Module]:
    """Embedding, one layer per transformer block, and the final projection."""
    return [EmbedLayer(model), *(BlockLayer(b) for b in model.blocks), FinalLayer(model)]
