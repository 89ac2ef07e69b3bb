"""Stage boundaries for the pipeline: balanced by parameter count (frozen ones included)."""

from __future__ import annotations

from torch import nn


def layer_param_counts(layers: list[nn.Module]) -> list[int]:
    """Parameters per layer, trainable or not; a module shared by two layers counts once (first use)."""
    seen: set[int] = set()
    counts = []
    for layer in layers:
        n = 0
        for p in layer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        counts.append(n)
    return counts


def balanced_parts(weights: list[int], num_stages: int) -> list[int]:
    """Contiguous split of ``weights`` into ``num_stages`` non-empty parts minimising the heaviest part.

    Returns N+1 boundaries ``[0, b1, ..., len(weights)]``.
    """
    n = len(weights)
    if num_stages > n:
        raise ValueError(f"pipeline_stages={num_stages} is more than the model's {n} layers")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def fits(limit: int) -> list[int] | None:
        parts, start = [0], 0
        for stage in range(num_stages):
            remaining_stages = num_stages - stage - 1
            end = start + 1
            if prefix[end] - prefix[start] > limit:
                return None
            while end < n - remaining_stages and prefix[end + 1] - prefix[start] <= limit:
                end += 1
            if stage == num_stages - 1 and end != n:
                return None
            parts.append(end)
            start = end
        return parts

    lo, hi = max(weights), prefix[-1]
    best = fits(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        found = fits(mid)
        if found is not None:
            best, hi = found, mid
        else:
            lo = mid + 1
    result = fits(lo) or best
    assert result is not None
    return result


def stage_parts(
    layers: list[nn.Module], num_stages: int, method: str = "parameters", split: list[int] | None = None
) -> list[int]:
    """Boundaries from an explicit ``partition_split``, or by ``method`` ('parameters' or 'uniform')."""
    n = len(layers)
    if split is not None:
        if split and split[-1] >= n:  # split=[] is valid for a single stage
            raise ValueError(f"partition_split {split} points past the model's {n} layers (valid: 1..{n - 1})")
        return [0, *split, n]
    weights = layer_param_counts(layers) if method == "parameters" else [1] * n
    return balanced_parts([max(w, 1) for w in weights], num_stages)
