"""The bases of pipeline layers: one wrapping a repeated block of the model (``ModelSpec.block_layers``), and the
output head.

Imported by a plugin's layer module (which imports torch anyway), never by its ``plugin.py``.
"""

from __future__ import annotations

from torch import nn


class WrappedBlock(nn.Module):
    """A layer holding one block of the model as ``self.block`` (its parameters keep the block's names under
    ``block.``); ``last``: the block is the last of its kind, whose layer may hand fewer tensors on (a layer that
    never does leaves it False). A subclass writes only ``forward``."""

    def __init__(self, block: nn.Module, last: bool = False) -> None:
        super().__init__()
        self.block, self.last = block, last


class OutputHead(nn.Module):
    """The last layer: the model's output norm and projection as ``self.norm_out`` and ``self.proj_out`` (their
    parameters keep the model's names). A subclass sets what else its ``forward`` needs after
    ``super().__init__(model)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.norm_out, self.proj_out = model.norm_out, model.proj_out
