""":class:`~{{package}}.model.TinyDiT` cut into pipeline layers
(what ``split_into_layers`` returns).

Each layer wraps the model's own submodules (so LoRA, per-stage loading and exports see one model) and maps one
tuple of tensors to the next. Every float tensor a layer returns is used by the next one (a pipeline stage may end
after any layer); the latent size travels as an integer tensor, and the last block drops the text tokens.
"""

from __future__ import annotations

import torch
from diffpipe_core.parts.blocks import OutputHead, WrappedBlock
from torch import nn

from {{package}}.model import TinyDiT, unpatchify

Tensors = tuple[torch.Tensor, ...]


class EmbedLayer(nn.Module):
    """``(x_t, t, text_embeds)`` -> ``(tokens, text tokens, temb, latent size)``."""

    def __init__(self, model: TinyDiT) -> None:
        super().__init__()
        self.x_embedder, self.context_embedder = model.x_embedder, model.context_embedder
        self.time_embed = model.time_embed

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text = inputs
        dtype = self.context_embedder.weight.dtype
        size = torch.tensor(x.shape[2:], dtype=torch.long, device=x.device)
        return self.x_embedder(x.to(dtype)), self.context_embedder(text.to(dtype)), self.time_embed(t), size


class BlockLayer(WrappedBlock):
    """One joint block; the last returns no text tokens, which nothing after it reads."""

    def forward(self, inputs: Tensors) -> Tensors:
        tokens, context, temb, size = inputs
        context, tokens = self.block(tokens, context, temb)
        return (tokens, temb, size) if self.last else (tokens, context, temb, size)


class FinalLayer(OutputHead):
    """``(tokens, temb, size)`` -> ``(velocity,)`` in the latents' layout, float32."""

    def __init__(self, model: TinyDiT) -> None:
        super().__init__(model)
        self.patch_size, self.channels = model.config.patch_size, model.config.in_channels

    def forward(self, inputs: Tensors) -> Tensors:
        tokens, temb, size = inputs
        out = self.proj_out(self.norm_out(tokens, temb))
        return (unpatchify(out, size.tolist(), self.patch_size, self.channels).float(),)


def split_into_layers(model: TinyDiT) -> list[nn.Module]:
    """The embedders, one layer per joint block, the output head."""
    blocks = model.transformer_blocks
    return [EmbedLayer(model), *(BlockLayer(b, i == len(blocks) - 1) for i, b in enumerate(blocks)), FinalLayer(model)]
