"""FLUX.3's caption text, as the modular pipeline's text block (``Flux3TextEncoderStep``) computes it: one caption per
call through its own ``_get_qwen3_vl_prompt_embeds`` (the chat template, the window padded to its pad multiple of 80
tokens, the tapped Qwen3-VL layers stacked), cached at a fixed length with the window's mask; and the check that a
text encoder fits the transformer.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch


def text_step() -> Any:
    """The modular pipeline's text block, whose defaults (pad multiple, tapped layers) are the recipe."""
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

    return Flux3TextEncoderStep()


def tapped_layers(step: Any) -> tuple[int, ...]:
    """The hidden states the block stacks (its ``text_encoder_out_layers`` default: 4, 8, ..., 32)."""
    return tuple(next(p.default for p in step.inputs if p.name == "text_encoder_out_layers"))


def encode_captions(step: Any, text_encoder: Any, processor: Any, captions: list[str], length: int,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """``text_embeds`` (B, length, layers x d): each caption's window from the block at ``max_sequence_length =
    length``, zeros after it; ``text_valid`` (B, length): 1 inside the window. bfloat16 when the encoder runs in it."""
    rows = []
    with torch.no_grad():
        for caption in captions:
            rows.append(step._get_qwen3_vl_prompt_embeds(
                text_encoder, processor, caption, device=device, max_sequence_length=length,
                pad_multiple=step.pad_multiple, hidden_states_layers=tapped_layers(step),
            )[0].cpu())
    dtype = torch.bfloat16 if rows[0].dtype == torch.bfloat16 else torch.float32
    embeds = torch.zeros(len(rows), length, rows[0].shape[-1], dtype=dtype)
    valid = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        embeds[i, : len(row)], valid[i, : len(row)] = row, 1
    return {"text_embeds": embeds, "text_valid": valid}


def text_fit_problem(text_config: Mapping[str, Any], transformer_config: Mapping[str, Any], where: Path) -> list[str]:
    """A problem (one line, empty list when none) when the Qwen3-VL config ``text_config`` (at ``where``) lacks a
    tapped layer or its stacked width is not the transformer's ``joint_attention_dim``."""
    text = text_config.get("text_config", text_config)
    layers, width = text.get("num_hidden_layers"), text.get("hidden_size")
    taps = tapped_layers(text_step())
    if layers is not None and int(layers) < max(taps):
        return [f"{where}: text_config.num_hidden_layers is {layers}; FLUX.3's text block stacks hidden states "
                f"{', '.join(map(str, taps))}, so the text encoder needs at least {max(taps)} layers"]
    joint = transformer_config.get("joint_attention_dim")
    if width is not None and joint is not None and len(taps) * int(width) != int(joint):
        made = len(taps) * int(width)
        return [f"{where}: text_config.hidden_size is {width}; {len(taps)} stacked layers make {made} values a token, "
                f"but the transformer's joint_attention_dim is {joint}: a text encoder of another model?"]
    return []
