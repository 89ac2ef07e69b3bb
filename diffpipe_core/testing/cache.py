"""Reading a cached dataset back in tests."""

from __future__ import annotations

from typing import Any

import torch


def rows_by_id(ds: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every sample's collated tensors of the cached dataset ``ds``, by sample id (the collate generator fixed)."""
    out = {}
    for group in ds.groups():
        batch = ds.collate(group, torch.Generator().manual_seed(0))
        for j, sample_id in enumerate(ds.sample_ids(group)):
            out[sample_id] = {k: v[j] for k, v in batch.items()}
    return out
