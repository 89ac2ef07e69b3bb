"""``diffpipe_core.parts.text.compacted`` / ``trimmed``: a caption's tokens, wherever its pipeline padded them (in the
middle, on the left), moved to the front in order with the rest zeroed; the cut to the longest caption keeps one
token at least. ``parts.flux2_vae.bn_stats``: the VAE batch norm's mean and ``sqrt(var + eps)``."""

from __future__ import annotations

import torch

from diffpipe_core.parts.text import compacted, trimmed


def test_tokens_move_to_the_front_in_order_and_the_cut_keeps_the_longest() -> None:
    embeds = torch.arange(1.0, 13.0).view(2, 6, 1)
    mask = torch.tensor([[True, True, False, False, True, False], [False, False, False, True, True, True]])
    out, kept = compacted(embeds, mask)
    assert out[:, :, 0].tolist() == [[1, 2, 5, 0, 0, 0], [10, 11, 12, 0, 0, 0]]
    assert kept.tolist() == [[True] * 3 + [False] * 3] * 2
    cut, cut_mask = trimmed(out, kept.long())
    assert cut.shape == (2, 3, 1) and cut_mask.dtype == torch.bool and cut_mask.all()
    none, none_mask = trimmed(torch.zeros(1, 4, 2), torch.zeros(1, 4, dtype=torch.long))
    assert none.shape == (1, 1, 2) and not none_mask.any()


def test_bn_stats_are_the_batch_norms_mean_and_std() -> None:
    from diffpipe_core.parts.flux2_vae import bn_stats
    from diffpipe_core.testing.tiny import flux2_vae

    torch.manual_seed(0)
    vae = flux2_vae(4, (8, 8))
    mean, std = bn_stats(vae)
    assert mean.shape == std.shape == (16,) and torch.equal(mean, vae.bn.running_mean)
    torch.testing.assert_close(std ** 2 - vae.config.batch_norm_eps, vae.bn.running_var)
