"""BucketSampler: bucket-pure micro-batches, disjoint data-parallel shares, per-epoch reshuffle, resume."""

from __future__ import annotations

import pytest

from diffpipe_core.data import BucketSampler
from diffpipe_core.data.sampler import data_key

# Three buckets of 10, 7 and 5 samples.
GROUPS = [list(range(0, 10)), list(range(10, 17)), list(range(17, 22))]
BUCKET_OF = {i: b for b, g in enumerate(GROUPS) for i in g}


def _epoch(sampler: BucketSampler) -> list[list[int]]:
    return list(sampler)


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_batches_are_bucket_pure_disjoint_and_equal_per_rank(dp):
    samplers = [BucketSampler(GROUPS, 2, r, dp, seed=7) for r in range(dp)]
    shares = [_epoch(s) for s in samplers]
    # Per bucket 5 + 3 + 2 = 10 full micro-batches of 2; dp ranks split the largest multiple of dp.
    per_rank = 10 // dp
    assert all(len(s) == per_rank == len(share) for s, share in zip(samplers, shares))
    seen = [i for share in shares for batch in share for i in batch]
    assert len(seen) == len(set(seen)) == per_rank * dp * 2  # disjoint, no duplicates
    for share in shares:
        for batch in share:
            assert len(batch) == 2 and len({BUCKET_OF[i] for i in batch}) == 1
    # Remainder: 1 sample of bucket 1 and 1 of bucket 2 never fill a batch, plus micro-batches beyond dp's multiple.
    assert samplers[0].remainder == 22 - per_rank * dp * 2
    assert samplers[0].remainder == 22 - len(seen)


def test_reshuffled_per_epoch_and_deterministic_from_seed():
    a = BucketSampler(GROUPS, 2, 0, 1, seed=1)
    b = BucketSampler(GROUPS, 2, 0, 1, seed=1)
    first, second = _epoch(a), _epoch(a)
    assert a.epoch == 2
    assert {tuple(sorted(b)) for b in first} != {tuple(sorted(b)) for b in second}  # new batches, not just order
    assert _epoch(b) == first and _epoch(b) == second  # same seed, same orders
    other = BucketSampler(GROUPS, 2, 0, 1, seed=2)
    assert _epoch(other) != first
    # Over epochs the samples that sat out change: none is left out for good.
    used = set()
    c = BucketSampler(GROUPS, 2, 0, 1, seed=3)
    for _ in range(10):
        used |= {i for batch in _epoch(c) for i in batch}
    assert used == set(range(22))


def test_resume_mid_epoch_equals_uninterrupted():
    full = BucketSampler(GROUPS, 2, 1, 2, seed=5)
    reference = _epoch(full) + _epoch(full)

    run = BucketSampler(GROUPS, 2, 1, 2, seed=5)
    got = _epoch(run)
    it = iter(run)
    got += [next(it), next(it)]
    state = run.state_dict()
    assert state["epoch"] == 1 and state["position"] == 2

    resumed = BucketSampler(GROUPS, 2, 1, 2, seed=5)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # the engine's epoch loop re-announces the saved epoch: the position is kept
    got += list(resumed)
    assert got == reference
    assert resumed.epoch == 2 and resumed.state_dict()["position"] == 0

    resumed.set_epoch(5)
    assert (resumed.epoch, resumed.position) == (5, 0)


def test_changed_dataset_restarts_the_saved_epoch(caplog):
    run = BucketSampler(GROUPS, 2, 0, 1, seed=5)
    it = iter(run)
    next(it)
    smaller = BucketSampler([GROUPS[0]], 2, 0, 1, seed=5)
    with caplog.at_level("WARNING", logger="diffpipe.data"):
        smaller.load_state_dict(run.state_dict())
    assert smaller.position == 0 and "restarting" in caplog.text


def test_too_little_data_is_an_error():
    with pytest.raises(ValueError, match="micro_batch_size"):
        BucketSampler([[0, 1, 2]], 4, 0, 1, seed=0)
    with pytest.raises(ValueError, match="dp_rank"):
        BucketSampler(GROUPS, 2, 2, 2, seed=0)


@pytest.mark.parametrize(("saved_dp", "new_dp"), [(2, 1), (1, 2), (2, 4)])
def test_another_data_parallel_degree_goes_on_in_the_epochs_global_order(saved_dp, new_dp):
    """The ranks of a run take the epoch's micro-batches interleaved (rank r: r, r + dp, ...); resumed under another
    number of ranks, the new ranks go on from the micro-batches the saved ranks took together."""
    order = BucketSampler(GROUPS, 1, 0, 1, seed=5).epoch_batches(0)  # 22 micro-batches of 1, in global order
    saved = [BucketSampler(GROUPS, 1, r, saved_dp, seed=5) for r in range(saved_dp)]
    for sampler in saved:
        it = iter(sampler)
        for _ in range(8 // saved_dp):  # 8 micro-batches taken together
            next(it)
    new = [BucketSampler(GROUPS, 1, r, new_dp, seed=5) for r in range(new_dp)]
    for sampler in new:
        sampler.load_state_dict(saved[0].state_dict())
    rest = [list(s) for s in new]
    taken = len(new[0]) * new_dp  # the epoch's micro-batches the new ranks share (a whole number each)
    assert [rest[i % new_dp][i // new_dp] for i in range(taken - 8)] == order[8:taken]


def test_the_data_key_holds_across_a_moved_project_but_not_a_renamed_item():
    """A project copied elsewhere with its data resumes where it stopped; a changed item is still a changed dataset."""
    ids = ["/home/a/run/data/cats/1.png", "/home/a/run/data/dogs/2.mp4#0", "/home/a/run/data/dogs/2.mp4#1"]
    moved = [i.replace("/home/a/run", "/mnt/b/copy") for i in ids]
    assert data_key(moved) == data_key(ids)
    assert data_key([*ids[:2], "/home/a/run/data/dogs/3.mp4#1"]) != data_key(ids)
    assert data_key(["/home/a/run/data/cats/1.png"]) == data_key(["/x/cats/1.png"]) != data_key(["/x/cats/2.png"])
