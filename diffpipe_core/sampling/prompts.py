"""Encode the sample prompts once, with the plugin's own encoders, then free them."""

from __future__ import annotations

import gc
from collections.abc import Sequence

import torch

from diffpipe_core.registry import ModelPlugin
from diffpipe_core.sampling.loop import PromptText
from diffpipe_core.types import EncodeBatch, ModelConfigBase


def encode_prompts(
    plugin: ModelPlugin,
    model_config: ModelConfigBase,
    prompts: Sequence[str],
    negative_prompt: str | None,
    device: torch.device,
) -> list[PromptText]:
    """Each prompt's text tensors (as ``encode_batch`` returns them for captions, batch 1, on the CPU), and
    the negative prompt's when ``negative_prompt`` is not None. The encoders are loaded for this call only."""
    captions = list(prompts) + ([negative_prompt] if negative_prompt is not None else [])
    encoders = plugin.require("load_encoders", model_config=model_config, device=device)
    try:
        with torch.no_grad():
            encoded = plugin.require("encode_batch", encoders=encoders, batch=EncodeBatch(captions=captions))
    finally:
        del encoders
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not encoded:
        raise ValueError(f"model plugin {plugin.name!r}: encode_batch returned no text tensors for the sample prompts")
    rows = [{key: value[i : i + 1].detach().cpu() for key, value in encoded.items()} for i in range(len(captions))]
    uncond = rows[-1] if negative_prompt is not None else None
    return [PromptText(cond=row, uncond=uncond) for row in rows[: len(prompts)]]
