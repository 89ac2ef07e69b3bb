"""``parts.text.trimmed``: cached text cut to the longest row's valid tokens (FLUX.3, Krea 2, Qwen-Image)."""

from __future__ import annotations

import torch

from diffpipe_core.parts.text import trimmed


def test_cached_text_is_cut_to_the_longest_row() -> None:
    embeds = torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    cut, kept = trimmed(embeds, mask)
    assert torch.equal(cut, embeds[:, :4]) and kept.dtype == torch.bool
    assert kept.tolist() == [[True, True, False, False], [True] * 4]
    # an all-padding batch (empty captions cached without tokens) keeps one token
    cut, kept = trimmed(embeds, torch.zeros_like(mask))
    assert cut.shape == (2, 1, 3) and not kept.any()
