"""NVIDIA's original Cosmos key layouts (1.0 and Predict2) and their diffusers counterparts.

One table, :func:`module_pairs`, maps each original module path to the diffusers ``CosmosTransformer3DModel``
module path (no fused tensors in either layout, so it is a renaming). Weight conversion both ways and the
ComfyUI LoRA export use it, so they cannot drift apart.

Original checkpoints keep the network under ``net.`` and carry training-only tensors the diffusers model
does not have (``logvar.*``, ``pos_embedder.seq``, ``accum_*`` counters, TransformerEngine ``_extra_state``);
those are skipped on read. diffusers 0.42's ``convert_cosmos_transformer_checkpoint_to_diffusers`` applies
the Predict2 table to 1.0 files (it empties the checkpoint before testing which version it holds), hence
this module.
"""

from __future__ import annotations

import re
from typing import Literal

import torch

Variant = Literal["1.0", "predict2"]
NET = "net."
TRAINING_ONLY = re.compile(r"^(logvar\.|pos_embedder\.|accum_)|_extra_state$")


def _block_pairs_1_0(i: int) -> list[tuple[str, str]]:
    nb, db = f"blocks.block{i}", f"transformer_blocks.{i}"
    pairs = []
    for k, attn in ((0, "attn1"), (1, "attn2")):
        a = f"{nb}.blocks.{k}.block.attn"
        pairs += [
            (f"{a}.to_q.0", f"{db}.{attn}.to_q"),
            (f"{a}.to_q.1", f"{db}.{attn}.norm_q"),
            (f"{a}.to_k.0", f"{db}.{attn}.to_k"),
            (f"{a}.to_k.1", f"{db}.{attn}.norm_k"),
            (f"{a}.to_v.0", f"{db}.{attn}.to_v"),
            (f"{a}.to_out.0", f"{db}.{attn}.to_out.0"),
        ]
    pairs += [(f"{nb}.blocks.2.block.layer1", f"{db}.ff.net.0.proj"), (f"{nb}.blocks.2.block.layer2", f"{db}.ff.net.2")]
    for k in range(3):
        pairs += [
            (f"{nb}.blocks.{k}.adaLN_modulation.1", f"{db}.norm{k + 1}.linear_1"),
            (f"{nb}.blocks.{k}.adaLN_modulation.2", f"{db}.norm{k + 1}.linear_2"),
        ]
    return pairs


def _block_pairs_predict2(i: int) -> list[tuple[str, str]]:
    nb, db = f"blocks.{i}", f"transformer_blocks.{i}"
    pairs = []
    for native, attn in (("self_attn", "attn1"), ("cross_attn", "attn2")):
        for n, d in (
            ("q_proj", "to_q"),
            ("k_proj", "to_k"),
            ("v_proj", "to_v"),
            ("output_proj", "to_out.0"),
            ("q_norm", "norm_q"),
            ("k_norm", "norm_k"),
        ):
            pairs.append((f"{nb}.{native}.{n}", f"{db}.{attn}.{d}"))
    pairs += [(f"{nb}.mlp.layer1", f"{db}.ff.net.0.proj"), (f"{nb}.mlp.layer2", f"{db}.ff.net.2")]
    for k, native in enumerate(("self_attn", "cross_attn", "mlp")):
        pairs += [
            (f"{nb}.adaln_modulation_{native}.1", f"{db}.norm{k + 1}.linear_1"),
            (f"{nb}.adaln_modulation_{native}.2", f"{db}.norm{k + 1}.linear_2"),
        ]
    return pairs


def module_pairs(variant: Variant, num_layers: int) -> list[tuple[str, str]]:
    """``(original module, diffusers module)`` for every module of a Cosmos transformer with ``num_layers`` blocks."""
    if variant == "1.0":
        top = [("affline_norm", "time_embed.norm"), ("final_layer.adaLN_modulation.1", "norm_out.linear_1")]
        top += [("final_layer.adaLN_modulation.2", "norm_out.linear_2")]
        blocks = _block_pairs_1_0
    elif variant == "predict2":
        top = [("t_embedding_norm", "time_embed.norm"), ("final_layer.adaln_modulation.1", "norm_out.linear_1")]
        top += [("final_layer.adaln_modulation.2", "norm_out.linear_2")]
        blocks = _block_pairs_predict2
    else:
        raise ValueError(f"unknown Cosmos variant {variant!r}; valid: '1.0', 'predict2'")
    pairs = [
        ("x_embedder.proj.1", "patch_embed.proj"),
        ("extra_pos_embedder", "learnable_pos_embed"),
        ("t_embedder.1.linear_1", "time_embed.t_embedder.linear_1"),
        ("t_embedder.1.linear_2", "time_embed.t_embedder.linear_2"),
        *top,
        ("final_layer.linear", "proj_out"),
    ]
    for i in range(num_layers):
        pairs += blocks(i)
    return pairs


def detect_variant(keys: list[str]) -> Variant | None:
    """``"1.0"``, ``"predict2"`` or None (neither) from the keys of an original-layout checkpoint."""
    bare = [k[len(NET) :] if k.startswith(NET) else k for k in keys]
    if any(k.startswith("blocks.block0.blocks.0.block.attn.") for k in bare):
        return "1.0"
    if any(k.startswith("blocks.0.self_attn.") for k in bare):
        return "predict2"
    return None


def count_blocks(keys: list[str], pattern: str) -> int:
    found = {int(m.group(1)) for k in keys if (m := re.match(pattern, k))}
    return max(found) + 1 if found else 0


def _split(key: str) -> tuple[str, str]:
    module, _, param = key.rpartition(".")
    return module, param


def diffusers_to_original(state: dict[str, torch.Tensor], variant: Variant) -> dict[str, torch.Tensor]:
    """A diffusers ``CosmosTransformer3DModel`` state dict in NVIDIA's layout, keys under ``net.``."""
    table = dict((d, n) for n, d in module_pairs(variant, count_blocks(list(state), r"transformer_blocks\.(\d+)\.")))
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        module, param = _split(key)
        if module not in table:
            raise KeyError(
                f"diffusers Cosmos state dict key {key!r} has no counterpart in the original {variant} layout"
            )
        out[f"{NET}{table[module]}.{param}"] = value
    return out


def original_to_diffusers(
    state: dict[str, torch.Tensor], variant: Variant, source: str = "original checkpoint"
) -> dict[str, torch.Tensor]:
    """An original-layout Cosmos transformer state dict (keys optionally under ``net.``) in diffusers keys.

    Training-only tensors are skipped; a key of the other variant or an unknown key raises a KeyError naming
    ``source`` and the key."""
    bare = {(k[len(NET) :] if k.startswith(NET) else k): v for k, v in state.items()}
    found = detect_variant(list(bare))
    if found is not None and found != variant:
        raise KeyError(f"{source}: this is a Cosmos {found} checkpoint; the model plugin reads Cosmos {variant}")
    pattern = r"blocks\.block(\d+)\." if variant == "1.0" else r"blocks\.(\d+)\."
    table = dict(module_pairs(variant, count_blocks(list(bare), pattern)))
    out: dict[str, torch.Tensor] = {}
    for key, value in bare.items():
        if TRAINING_ONLY.search(key):
            continue
        module, param = _split(key)
        if module not in table:
            raise KeyError(f"{source}: unexpected key {key!r} for a Cosmos {variant} transformer in NVIDIA's layout")
        out[f"{table[module]}.{param}"] = value
    return out
