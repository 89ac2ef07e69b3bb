"""The base of a pipeline layer that wraps one of the model's repeated blocks (``ModelSpec.block_layers``).

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
