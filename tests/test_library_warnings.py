"""Library warnings that concern diffpipe's own use of a library stay out of a normal run (``--verbose`` shows them)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from diffpipe_core import quiet


def _weight_norm_warnings(silenced: bool) -> list[str]:
    saved = dict(os.environ)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if silenced:
                quiet.quiet_libraries(cuda=False)
            torch.nn.utils.weight_norm(torch.nn.Conv1d(2, 2, 3))  # as diffusers' audio VAEs build their layers
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return [str(w.message) for w in caught if "weight_norm" in str(w.message)]


def test_torchs_weight_norm_deprecation_is_not_the_users_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    assert _weight_norm_warnings(silenced=False), "torch no longer warns: drop the pattern from LIBRARY_WARNINGS"
    assert _weight_norm_warnings(silenced=True) == []
