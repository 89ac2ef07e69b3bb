"""OmniGen2's prompt encoding and sampling times, as its reference pipeline computes them (``OmniGen2Pipeline``'s
``_apply_chat_template``, ``_get_qwen2_prompt_embeds``; its ``FlowMatchEulerDiscreteScheduler.set_timesteps``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def chat_prompts(tokenizer: Any, captions: list[str], system_prompt: str) -> list[str]:
    """Each caption as the user turn after ``system_prompt``, through the tokenizer's own chat template (no
    generation prompt)."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system_prompt}, {"role": "user", "content": c}],
            tokenize=False, add_generation_prompt=False,
        )
        for c in captions
    ]


def encode_prompts(
    mllm: Any, tokenizer: Any, captions: list[str], system_prompt: str, max_length: int, padding: str = "longest"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embeds (B, L, d), mask (B, L))``: Qwen2.5-VL's last hidden state of the chat-templated captions, tokenized
    with right padding (``"longest"`` as the pipeline, ``"max_length"`` for a fixed cache shape: the real tokens'
    states are the same) and truncated at ``max_length``."""
    tokens = tokenizer(chat_prompts(tokenizer, captions, system_prompt), padding=padding, max_length=max_length,
                       truncation=True, return_tensors="pt")
    device = next(mllm.parameters()).device
    ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
    with torch.no_grad():
        states = mllm(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    return states, mask


def omnigen_times(steps: int, num_tokens: int, dynamic_time_shift: bool = True) -> torch.Tensor:
    """``steps + 1`` float32 times from 0 (noise) to 1: ``linspace(0, 1, steps + 1)[:-1]`` (float32), shifted as
    ``t / (m - m t + t)`` with ``m = sqrt(num_tokens) / 40`` (``num_tokens``: the latent's height x width), then 1."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    t = np.linspace(0, 1, steps + 1, dtype=np.float32)[:-1]
    if dynamic_time_shift:
        m = np.sqrt(num_tokens) / 40
        t = t / (m - m * t + t)
    return torch.cat([torch.from_numpy(t).to(torch.float32), torch.ones(1)])
