"""Wan VACE (``WanVACETransformer3DModel``) cut into pipeline layers: embedders, each VACE block, each transformer
block, the head.

``WanVACETransformer3DModel.forward`` runs every VACE block first (a chain over the control tokens, each block giving
one hint), then the transformer blocks, adding hint ``i`` after block ``vace_layers[i]``. Here the VACE blocks are
layers of their own before the transformer blocks, so the hints are carried between layers (and stages) as extra
tensors of the tuple until the block that adds them:

- into the first layer: ``(x, t, text, control)``: the noisy latents ``(B, C, F, h, w)``, the flow time ``(B,)`` in
  (0, 1), the UMT5 embeddings and the VACE conditioning ``(B, vace_in_channels, F, h, w)``
  (:func:`diffpipe_wan.vace_encoding.context`);
- between VACE blocks: Wan's ``(hidden, context, modulation, temb, rope_cos, rope_sin, grid)``, the control tokens
  and the hints made so far (the last VACE block drops the control tokens);
- between transformer blocks: Wan's seven tensors and the hints not yet added (block ``vace_layers[i]`` adds and
  drops the first); the head is Wan's.

Chained, the layers compute the diffusers model with ``control_hidden_states_scale`` 1 (``WanVACEPipeline``'s
default ``conditioning_scale``).
"""

from __future__ import annotations

import torch
from torch import nn

from diffpipe_core.parts.blocks import WrappedBlock
from diffpipe_wan.layers import EmbedLayer, HeadLayer

Tensors = tuple[torch.Tensor, ...]


class VaceEmbedLayer(EmbedLayer):
    """Wan's embedders and the VACE patch embedding of the conditioning (zero-padded to the video's token count, as
    the model pads it)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.vace_patch_embedding = model.vace_patch_embedding

    def forward(self, inputs: Tensors) -> Tensors:
        x, t, text, control = inputs
        out = super().forward((x, t, text))
        hidden = out[0]
        control = self.vace_patch_embedding(control.to(self.vace_patch_embedding.weight.dtype))
        control = control.flatten(2).transpose(1, 2)
        padding = control.new_zeros(control.shape[0], hidden.shape[1] - control.shape[1], control.shape[2])
        return (*out, torch.cat([control, padding], dim=1))


class VaceBlockLayer(WrappedBlock):
    """One ``WanVACETransformerBlock``: updates the control tokens and appends its hint."""

    def forward(self, inputs: Tensors) -> Tensors:
        hidden, context, modulation, temb, cos, sin, grid, control, *hints = inputs
        hint, control = self.block(hidden, context, control, modulation, (cos, sin))
        wan = (hidden, context, modulation, temb, cos, sin, grid)
        return (*wan, *hints, hint) if self.last else (*wan, control, *hints, hint)


class VaceTransformerBlockLayer(WrappedBlock):
    """One ``WanTransformerBlock``; a block of ``vace_layers`` adds the next hint to its output."""

    def __init__(self, block: nn.Module, last: bool, adds_hint: bool) -> None:
        super().__init__(block, last)
        self.adds_hint = adds_hint

    def forward(self, inputs: Tensors) -> Tensors:
        hidden, context, modulation, temb, cos, sin, grid, *hints = inputs
        hidden = self.block(hidden, context, modulation, (cos, sin))
        if self.adds_hint:
            hidden = hidden + hints[0]
            hints = hints[1:]
        return (hidden, temb, grid) if self.last else (hidden, context, modulation, temb, cos, sin, grid, *hints)


def split_into_layers(model: nn.Module) -> list[nn.Module]:
    """The ordered pipeline layers of a diffusers ``WanVACETransformer3DModel`` (sharing its parameters)."""
    blocks, vace = list(model.blocks), list(model.vace_blocks)
    vace_layers = set(model.config.vace_layers)
    if not blocks or not vace:
        raise ValueError("a Wan VACE transformer needs transformer blocks and VACE blocks to be split into layers")
    return [
        VaceEmbedLayer(model),
        *(VaceBlockLayer(b, last=i == len(vace) - 1) for i, b in enumerate(vace)),
        *(VaceTransformerBlockLayer(b, i == len(blocks) - 1, i in vace_layers) for i, b in enumerate(blocks)),
        HeadLayer(model),
    ]
