"""Pipeline layers: each wraps the model's own submodules (so LoRA, checkpoints and exports see one
model) and maps one tuple of tensors to the next. Float tensors crossing a boundary (tokens, c) are
all used by the next layer; the latent size travels as an integer tensor."""

from __future__ import annotations

import torch
from torch import nn

from {{package}}.model import Block, Embedder, Head, TinyDiT

Tensors = tuple[torch.Tensor, ...]


class EmbedLayer(nn.Module):
    def __init__(self, embedder: Embedder) -> None:
        super().__init__()
        self.embedder = embedder

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text = inputs
        dtype = self.embedder.x_embedder.weight.dtype
        tokens, c = self.embedder(x.to(dtype), t, text.to(dtype))
        return tokens, c, torch.tensor(x.shape[2:], dtype=torch.long, device=x.device)


class BlockLayer(nn.Module):
    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: Tensors) -> Tensors:
        tokens, c, size = inputs
        return self.block(tokens, c), c, size


class FinalLayer(nn.Module):
    def __init__(self, head: Head) -> None:
        super().__init__()
        self.head = head

    def forward(self, inputs: Tensors) -> Tensors:
        tokens, c, size = inputs
        f, h, w = (int(n) for n in size)
        return (self.head(tokens, c, f, h, w).float(),)


def split(model: TinyDiT) -> list[nn.Module]:
    return [EmbedLayer(model.embedder), *(BlockLayer(b) for b in model.blocks), FinalLayer(model.head)]
