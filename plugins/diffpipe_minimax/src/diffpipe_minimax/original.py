"""The original MiniMax H3 key layout (the reference implementation's, as ComfyUI's ``comfy/ldm/minimax/model.py``
holds it and Comfy-Org/MiniMax-H3's single files store it), as a key table: the inverse of diffusers'
``convert_minimax_h3_transformer_checkpoint_to_diffusers`` for the published single files.

Each block's attention is one fused ``attn.qkv_proj`` (``[q; k; v]`` stacked, the published files' row order) and an
``attn.out_proj``; its MLP ``mlp.fc1`` holds ``[gate; value]`` where diffusers' SwiGLU ``ff.net.0.proj`` holds
``[value; gate]`` (the halves swapped) and ``mlp.fc2`` is ``ff.net.2``; the QK norms are ``q_norm`` / ``k_norm``.
The blocks are ``blocks.N`` (diffusers' ``transformer_blocks.N``), the text refiner's ``token_refiner.blocks.N``,
the projections ``video_patch_proj`` / ``audio_patch_proj`` / ``condition_proj``, the time MLP ``time_embedder.proj_in``
/ ``proj_out``, the output ``final_layer.norm`` / ``adaln_proj.linear`` / ``video_out`` / ``audio_out``. The same
table reads such a file, writes the ``single_file`` export and the ComfyUI LoRA (``diffusion_model.`` + these names,
a fused ``qkv_proj`` for q, k and v, with ``.alpha``), which diffusers' ``MiniMaxH3LoraLoaderMixin`` reads too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffpipe_core.parts.layout import KeyTable, Module

RENAMES = (
    ("token_refiner.blocks", "token_refiner.refiner_blocks"),
    ("blocks", "transformer_blocks"),
    ("time_embedder.proj_in", "time_embedder.linear_1"),
    ("time_embedder.proj_out", "time_embedder.linear_2"),
    ("adaln_t_table", "time_embedder.table"),  # the pruned (curve-form) checkpoint's table (diffpipe_minimax.pruned)
    ("video_patch_proj", "proj_in"),
    ("audio_patch_proj", "audio_proj_in"),
    ("condition_proj", "context_embedder"),
    ("final_layer.norm", "norm_out.norm"),
    ("final_layer.adaln_proj.linear", "norm_out.linear"),
    ("final_layer.video_out", "proj_out"),
    ("final_layer.audio_out", "audio_proj_out"),
)


def block_modules(original: str, ours: str) -> tuple[Module, ...]:
    """One block's (or refiner block's) modules that are not plain renames of the block's prefix."""
    return (
        Module(f"{original}.attn.qkv_proj", tuple(f"{ours}.attn.to_{p}" for p in "qkv")),
        Module(f"{original}.attn.out_proj", (f"{ours}.attn.to_out.0",)),
        Module(f"{original}.attn.q_norm", (f"{ours}.attn.norm_q",), params=None),
        Module(f"{original}.attn.k_norm", (f"{ours}.attn.norm_k",), params=None),
        Module(f"{original}.mlp.fc1", (f"{ours}.ff.net.0.proj",), swap=True),
        Module(f"{original}.mlp.fc2", (f"{ours}.ff.net.2",)),
    )


def layout(num_layers: int, num_refiner_layers: int) -> KeyTable:
    """The table of a transformer of ``num_layers`` blocks and ``num_refiner_layers`` refiner blocks."""
    modules = tuple(m for i in range(num_layers) for m in block_modules(f"blocks.{i}", f"transformer_blocks.{i}"))
    modules += tuple(m for i in range(num_refiner_layers)
                     for m in block_modules(f"token_refiner.blocks.{i}", f"token_refiner.refiner_blocks.{i}"))
    return KeyTable(modules, name="original MiniMax H3", model="MiniMax H3 transformer", renames=RENAMES,
                    passthrough=True, skip=r"^rope\.inv_freq$")


def layout_for_config(config: Mapping[str, Any]) -> KeyTable:
    return layout(int(config.get("num_layers", 50)), int(config.get("num_refiner_layers", 2)))


def lora_layout(state: Mapping[str, Any]) -> KeyTable:
    """The layout for a ComfyUI LoRA, sized from the LoRA's own module names."""
    from diffpipe_core.parts.layout import count_blocks

    keys = list(state)
    return layout(count_blocks(keys, r"transformer_blocks\.(\d+)\."),
                  count_blocks(keys, r"token_refiner\.refiner_blocks\.(\d+)\."))
