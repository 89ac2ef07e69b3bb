"""Issue 9.16: benchmark sides alternate in pairs (which goes first swaps) and report the median ratio with
its spread, so a load that drifts on a shared machine cannot pass for a difference between the sides."""

from __future__ import annotations

import pytest

from diffpipe_core.testing.bench import alternate, ratio_report


def test_sides_alternate_and_the_report_gives_median_and_spread() -> None:
    calls: list[str] = []
    values = {"a": iter([2.0, 2.4, 3.0, 2.2]), "b": iter([1.0, 2.0, 2.0, 2.0])}

    def side(name: str):
        def measure() -> float:
            calls.append(name)
            return next(values[name])
        return measure

    pairs = alternate(side("a"), side("b"), 4)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert pairs == [(2.0, 1.0), (2.4, 2.0), (3.0, 2.0), (2.2, 2.0)]
    text = ratio_report(pairs, "overhead ratio")
    # ratios 2.0, 1.2, 1.5, 1.1 -> median 1.35, range 1.1-2.0
    assert text.startswith("overhead ratio: median 1.350 over 4 alternating pairs (spread 1.100-2.000, IQR ")
    with pytest.raises(ValueError, match="at least 3 pairs"):
        alternate(side("a"), side("b"), 2)
