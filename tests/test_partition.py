"""Stage boundaries (diffpipe_core/engine/partition.py): optimal balance, frozen parameters counted."""

from __future__ import annotations

import itertools
import random

import pytest
from deepspeed.runtime import utils as ds_utils
from torch import nn

from diffpipe_core.engine.partition import balanced_parts, layer_param_counts, min_max_parts, stage_parts


def heaviest(weights: list[int], parts: list[int]) -> int:
    return max(sum(weights[a:b]) for a, b in itertools.pairwise(parts))


def brute_force_best(weights: list[int], num_stages: int) -> int:
    n = len(weights)
    return min(heaviest(weights, [0, *cuts, n]) for cuts in itertools.combinations(range(1, n), num_stages - 1))


def assert_valid(parts: list[int], n: int, num_stages: int) -> None:
    assert len(parts) == num_stages + 1 and parts[0] == 0 and parts[-1] == n, parts
    assert all(a < b for a, b in itertools.pairwise(parts)), f"empty stage in {parts}"


def test_balanced_parts_minimises_the_heaviest_stage() -> None:
    rng = random.Random(0)
    cases = [([5, 1, 1, 1, 1, 5], 2), ([1, 1, 1, 10], 2), ([10, 1, 1, 1], 3), ([0, 0, 7, 0], 2), ([3], 1)]
    for _ in range(300):
        n = rng.randint(1, 9)
        weights = [rng.choice([0, 1, 2, 3, 5, 8, 100, 1000]) for _ in range(n)]
        cases.append((weights, rng.randint(1, n)))
    for weights, num_stages in cases:
        parts = balanced_parts(weights, num_stages)
        assert_valid(parts, len(weights), num_stages)
        assert heaviest(weights, parts) == brute_force_best(weights, num_stages), (weights, num_stages, parts)


def test_every_stage_gets_a_layer_even_when_one_layer_dominates() -> None:
    assert balanced_parts([1000, 1, 1, 1], 4) == [0, 1, 2, 3, 4]
    parts = balanced_parts([1, 1, 1, 1000], 3)
    assert_valid(parts, 4, 3)
    assert parts[-2] == 3  # the heavy layer alone on the last stage


def test_more_stages_than_layers_is_an_error_naming_the_layer_count() -> None:
    with pytest.raises(ValueError, match=r"pipeline_stages=4 is more than the model's 3 layers"):
        balanced_parts([1, 2, 3], 4)


def test_layer_param_counts_include_frozen_and_count_shared_modules_once() -> None:
    frozen = nn.Linear(10, 10).requires_grad_(False)  # 110 parameters
    trainable = nn.Linear(10, 2)  # 22
    shared = nn.Linear(3, 3)  # 12, used by two layers
    layers = [frozen, nn.Sequential(trainable, shared), nn.Sequential(shared, nn.Linear(2, 1))]
    assert layer_param_counts(layers) == [110, 22 + 12, 3]


def test_stage_parts_honours_an_explicit_split() -> None:
    layers = [nn.Linear(4, 4) for _ in range(5)]
    assert stage_parts(layers, 3, split=[1, 4]) == [0, 1, 4, 5]
    assert stage_parts(layers, 1, split=[]) == [0, 5]
    with pytest.raises(ValueError, match=r"partition_split \[2, 5\] points past the model's 5 layers"):
        stage_parts(layers, 3, split=[2, 5])


def test_stage_parts_uniform_ignores_sizes() -> None:
    layers = [nn.Linear(100, 100), nn.Identity(), nn.Identity(), nn.Identity()]
    assert stage_parts(layers, 2, method="uniform") == [0, 2, 4]
    assert stage_parts(layers, 2, method="parameters") == [0, 1, 4]  # weightless layers count as 1


class LoraLinear(nn.Module):
    """A frozen base Linear with a small trainable low-rank update (what peft builds)."""

    def __init__(self, dim: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim).requires_grad_(False)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)


def test_lora_model_is_split_by_total_size_not_trainable_size() -> None:
    dim = 64
    # A frozen embedder without LoRA, four LoRA blocks, a small fully trainable head.
    layers = [nn.Linear(dim, dim).requires_grad_(False), *(LoraLinear(dim) for _ in range(4)), nn.Linear(dim, 8)]
    total = layer_param_counts(layers)
    trainable = [sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in layers]

    ours = stage_parts(layers, 2)
    assert ours == [0, 3, 6]
    # DeepSpeed's partition_method="parameters" balances trainable counts only: it would put the
    # embedder and three of the four big frozen blocks on stage 0, a third more than our heaviest stage.
    deepspeeds = [int(b) for b in ds_utils.partition_balanced(weights=trainable, num_parts=2)]
    assert deepspeeds == [0, 4, 6]
    assert heaviest(total, deepspeeds) > 1.3 * heaviest(total, ours)


def brute_force_min_max(n: int, num_stages: int, cost, valid) -> tuple[int, int]:
    """(least max cost, least sum of squares among those) over every split all of whose stages are valid."""
    best = None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        parts = [0, *cuts, n]
        if not all(valid(a, b) for a, b in itertools.pairwise(parts)):
            continue
        costs = [cost(s, a, b) for s, (a, b) in enumerate(itertools.pairwise(parts))]
        key = (max(costs), sum(c * c for c in costs))
        best = key if best is None or key < best else best
    return best


def test_min_max_parts_is_optimal_for_stage_dependent_costs_and_then_most_even() -> None:
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(1, 8)
        stages = rng.randint(1, n)
        weights = [rng.choice([0, 1, 2, 5, 9, 40]) for _ in range(n)]
        extra = [rng.choice([0, 3, 10]) for _ in range(n)]
        trainable = [rng.random() < 0.6 for _ in range(n)]

        def cost(s: int, i: int, j: int, weights=weights, extra=extra, stages=stages) -> int:
            return sum(weights[i:j]) + (stages - s) * sum(extra[i:j])  # a first stage holds more micro-batches

        def valid(i: int, j: int, trainable=trainable) -> bool:
            return any(trainable[i:j])

        parts = min_max_parts(n, stages, cost, valid)
        assert_valid(parts, n, stages)
        want = brute_force_min_max(n, stages, cost, valid) or brute_force_min_max(n, stages, cost, lambda i, j: True)
        got = [cost(s, a, b) for s, (a, b) in enumerate(itertools.pairwise(parts))]
        assert (max(got), sum(c * c for c in got)) == want, (weights, extra, trainable, stages, parts)


def test_min_max_parts_keeps_a_trainable_layer_on_every_stage() -> None:
    # a heavy frozen embedder alone on stage 0 would balance best, but that stage would train nothing
    weights, trainable = [10, 3, 3, 3, 3], [False, True, True, True, True]
    parts = min_max_parts(5, 2, lambda s, i, j: sum(weights[i:j]), lambda i, j: any(trainable[i:j]))
    assert parts == [0, 2, 5]
    assert min_max_parts(5, 2, lambda s, i, j: sum(weights[i:j])) == [0, 1, 5]
