"""The original Lightricks (LTX-Video repository, ComfyUI) key layout of the transformer.

It differs from diffusers' ``LTXVideoTransformer3DModel`` names only by plain renames, no fused tensors
(the inverse of diffusers' ``convert_ltx_transformer_checkpoint_to_diffusers``):

- ``proj_in`` <-> ``patchify_proj``, ``time_embed`` <-> ``adaln_single`` (top-level modules),
- ``attnN.norm_q`` / ``attnN.norm_k`` <-> ``attnN.q_norm`` / ``attnN.k_norm`` (inside the blocks).

Downloaded checkpoints hold these keys under ``model.diffusion_model.`` and the VAE under ``vae.``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

FILE_PREFIX = "model.diffusion_model."
TOP_LEVEL = {"proj_in": "patchify_proj", "time_embed": "adaln_single"}
IN_BLOCKS = {"norm_q": "q_norm", "norm_k": "k_norm"}
_BLOCK_NORM = re.compile(r"^(transformer_blocks\.\d+\.attn\d\.)(\w+)(\..*)$")


def _rename(name: str, top: dict[str, str], inner: dict[str, str]) -> str:
    head, dot, rest = name.partition(".")
    if head in top:
        return top[head] + dot + rest
    m = _BLOCK_NORM.match(name)
    if m and m.group(2) in inner:
        return m.group(1) + inner[m.group(2)] + m.group(3)
    return name


def original_name(name: str) -> str:
    """A diffusers parameter or module name -> its original Lightricks name."""
    return _rename(name, TOP_LEVEL, IN_BLOCKS)


def diffusers_name(name: str) -> str:
    """An original Lightricks name (without ``model.diffusion_model.``) -> the diffusers name."""
    return _rename(name, {v: k for k, v in TOP_LEVEL.items()}, {v: k for k, v in IN_BLOCKS.items()})


def to_original(state: dict) -> dict:
    """A diffusers transformer state dict in original key names (no file prefix)."""
    return {original_name(k): v for k, v in state.items()}


def key_map_for(file_keys: list[str]) -> Callable[[str], str | None]:
    """The file key -> diffusers name map of one original single file. When the file holds its transformer under
    ``model.diffusion_model.`` (as downloaded, beside ``vae.*`` and other parts), only those keys are the
    transformer's; otherwise every key is."""
    if any(k.startswith(FILE_PREFIX) for k in file_keys):
        return lambda key: diffusers_name(key[len(FILE_PREFIX) :]) if key.startswith(FILE_PREFIX) else None
    return diffusers_name
