"""Stage boundaries for the pipeline: balanced by parameter count (frozen ones included), by layer count, or (the
``memory`` method, :mod:`diffpipe_core.engine.stage_plan`) by each stage's estimated peak memory."""

from __future__ import annotations

from collections.abc import Callable

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


def min_max_parts(
    n: int,
    num_stages: int,
    cost: Callable[[int, int, int], int],
    valid: Callable[[int, int], bool] = lambda i, j: True,
) -> list[int]:
    """Contiguous split of ``n`` layers into ``num_stages`` non-empty stages minimising the largest
    ``cost(stage, start, stop)`` (which may depend on the stage: a pipeline's first stage holds more micro-batches),
    and among those the most even (least sum of squared costs). Stages for which ``valid(start, stop)`` is false
    are avoided while a split without them exists. Exact (dynamic programming), O(num_stages * n^2) cost calls.

    Returns N+1 boundaries ``[0, b1, ..., n]``.
    """
    if num_stages > n:
        raise ValueError(f"pipeline_stages={num_stages} is more than the model's {n} layers")
    table: dict[tuple[int, int, int], int] = {}

    def c(s: int, i: int, j: int) -> int:
        key = (s, i, j)
        if key not in table:
            table[key] = cost(s, i, j)
        return table[key]

    for check in (valid, lambda i, j: True):
        limit = _best(n, num_stages, c, check, lambda acc, v: max(acc, v), None)
        if limit is not None:
            return _best(n, num_stages, c, check, lambda acc, v: acc + v * v, limit)  # type: ignore[return-value]
    raise AssertionError("unreachable: an unconstrained split always exists")


def _best(n: int, stages: int, cost: Callable[[int, int, int], int], valid: Callable[[int, int], bool],
          combine: Callable[[int, int], int], limit: int | None) -> int | list[int] | None:
    """One DP pass. Without ``limit``: the least achievable max cost (None if ``valid`` rules out every split).
    With ``limit``: the boundaries minimising ``combine`` over stages whose cost is at most ``limit``."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    came = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf or not valid(i, j):
                    continue
                v = cost(k - 1, i, j)
                if limit is not None and v > limit:
                    continue
                total = combine(best[k - 1][i], v)
                if total < best[k][j]:
                    best[k][j], came[k][j] = total, i
    if best[stages][n] == inf:
        return None
    if limit is None:
        return int(best[stages][n])
    parts, j = [n], n
    for k in range(stages, 0, -1):
        j = came[k][j]
        parts.append(j)
    return parts[::-1]
