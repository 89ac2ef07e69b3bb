"""The global gradient norm: the right value, non-finite detection, and one host sync per step."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffpipe_core.engine.grad_norm import clip_grads_, global_grad_norm

CPU = torch.device("cpu")
HOST_SYNC_OPS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.item")


def grads(n: int = 200) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 4, generator=g).to(torch.bfloat16 if i % 2 else torch.float32) for i in range(n)]


class CountHostSyncs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(str(func).startswith(op) for op in HOST_SYNC_OPS):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_norm_of_all_gradients_over_data_parallel_replicas() -> None:
    gs = grads()
    expected = math.sqrt(sum(float(g.float().square().sum()) for g in gs))
    assert global_grad_norm(gs, 1, CPU, all_reduce=lambda t: None) == pytest.approx(expected, rel=1e-4)
    # two replicas holding the same gradients: the all-reduce doubles the sum, the norm stays
    assert global_grad_norm(gs, 2, CPU, all_reduce=lambda t: t.mul_(2)) == pytest.approx(expected, rel=1e-4)


def test_a_non_finite_gradient_anywhere_gives_nan() -> None:
    for bad in (float("nan"), float("inf")):
        gs = grads()
        gs[137][3, 1] = bad
        assert math.isnan(global_grad_norm(gs, 1, CPU, all_reduce=lambda t: None))
    # another rank's non-finite flag arrives through the all-reduce
    assert math.isnan(global_grad_norm(grads(), 1, CPU, all_reduce=lambda t: t[0].add_(1)))


def test_one_host_sync_for_any_number_of_gradient_tensors() -> None:
    with CountHostSyncs() as counter:
        global_grad_norm(grads(200), 1, CPU, all_reduce=lambda t: None)
    assert counter.count <= 2, f"{counter.count} host syncs for 200 gradient tensors"


def test_clipping_scales_to_the_limit() -> None:
    gs = [g.float() for g in grads(10)]
    norm = global_grad_norm(gs, 1, CPU, all_reduce=lambda t: None)
    clip_grads_(gs, norm / 4, norm)
    assert global_grad_norm(gs, 1, CPU, all_reduce=lambda t: None) == pytest.approx(norm / 4, rel=1e-4)
