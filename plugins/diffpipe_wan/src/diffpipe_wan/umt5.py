"""The original layout of Wan's UMT5 text encoder (the Wan repositories' ``T5Encoder``: ``models_t5_umt5-xxl-enc``,
and Kijai's ``umt5-xxl-enc-bf16.safetensors`` for ComfyUI-WanVideoWrapper), as a key table for transformers'
``UMT5EncoderModel``. ComfyUI's own ``umt5_xxl_fp16.safetensors`` uses transformers' names and needs none.

Renames only: ``token_embedding`` = ``shared`` (tied to ``encoder.embed_tokens``), ``norm`` =
``encoder.final_layer_norm``; in block N ``norm1`` / ``attn`` / ``pos_embedding.embedding`` = ``layer.0``'s
``layer_norm`` / ``SelfAttention`` / ``SelfAttention.relative_attention_bias`` (UMT5 has one per block), ``norm2`` /
``ffn.gate.0`` / ``ffn.fc1`` / ``ffn.fc2`` = ``layer.1``'s ``layer_norm`` / ``DenseReluDense.wi_0`` / ``wi_1`` / ``wo``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable


def umt5_table(config: Mapping[str, Any]) -> KeyTable:
    """The table of a ``UMT5EncoderModel`` config (its ``num_layers`` blocks)."""
    renames = [("token_embedding", "shared"), ("token_embedding", "encoder.embed_tokens"),
               ("norm", "encoder.final_layer_norm")]  # fmt: skip
    for i in range(int(config.get("num_layers", 24))):
        attention, ffn = f"encoder.block.{i}.layer.0", f"encoder.block.{i}.layer.1"
        renames += [
            (f"blocks.{i}.pos_embedding.embedding", f"{attention}.SelfAttention.relative_attention_bias"),
            (f"blocks.{i}.attn", f"{attention}.SelfAttention"),
            (f"blocks.{i}.norm1", f"{attention}.layer_norm"),
            (f"blocks.{i}.norm2", f"{ffn}.layer_norm"),
            (f"blocks.{i}.ffn.gate.0", f"{ffn}.DenseReluDense.wi_0"),
            (f"blocks.{i}.ffn.fc1", f"{ffn}.DenseReluDense.wi_1"),
            (f"blocks.{i}.ffn.fc2", f"{ffn}.DenseReluDense.wo"),
        ]
    return KeyTable((), "original Wan T5", "UMT5 text encoder", ("",), "", tuple(renames))
