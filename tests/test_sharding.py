import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shoal.data import EpochPlan, shard_range, split_sizes
from shoal.data.sharding import batch_bounds
from shoal.errors import ShoalError


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_split_sizes_cover_and_balance(total, parts):
    sizes = split_sizes(total, parts)
    assert sum(sizes) == total and len(sizes) == parts
    assert max(sizes) - min(sizes) <= 1
    starts = [shard_range(total, parts, i) for i in range(parts)]
    assert starts[0][0] == 0 and starts[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(starts, starts[1:], strict=False))


@given(st.integers(1, 3000), st.integers(1, 256), st.integers(1, 8), st.integers(0, 3))
def test_every_sample_read_exactly_once_per_epoch(n, batch, world, epoch):
    global_batch = batch * world
    if n < world:
        return
    plan = EpochPlan(n, global_batch, world, seed=5)
    perm = plan.permutation(epoch)
    seen = []
    for step in range(plan.steps_per_epoch):
        sizes = []
        for rank in range(world):
            idx, n_global = plan.local(perm, step, rank)
            seen.append(idx)
            sizes.append(len(idx))
        assert sum(sizes) == n_global
        assert min(sizes) >= 1, "every rank gets at least one sample each step"
        assert max(sizes) - min(sizes) <= 1
    assert torch.equal(torch.sort(torch.cat(seen)).values, torch.arange(n))


def test_tail_smaller_than_world_joins_previous_batch():
    assert batch_bounds(10, 4, 4) == [(0, 4), (4, 10)]  # 2 left over < 4 workers
    assert batch_bounds(13, 4, 2) == [(0, 4), (4, 8), (8, 13)]
    assert batch_bounds(14, 4, 2) == [(0, 4), (4, 8), (8, 12), (12, 14)]


def test_permutation_differs_by_epoch_and_is_reproducible():
    plan = EpochPlan(100, 10, 2, seed=0)
    assert torch.equal(plan.permutation(3), EpochPlan(100, 10, 2, seed=0).permutation(3))
    assert not torch.equal(plan.permutation(0), plan.permutation(1))


def test_fewer_samples_than_workers_is_an_error():
    with pytest.raises(ShoalError, match="fewer than the 3 workers"):
        EpochPlan(2, 3, 3, 0)
