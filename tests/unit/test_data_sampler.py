"""GlobalBatchSampler: exactly-once per epoch, parity with DistributedBatches, resume on another world size."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from trainmesh.data import GlobalBatchSampler
from trainmesh.distribution.dataset import DistributedBatches

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:The last .* samples cannot be split")]


def samplers(n, gbs, world, *, k=1, seed=3, **kw):
    return [
        GlobalBatchSampler(
            n, global_batch_size=gbs, data_parallel_size=world, data_index=r, micro_batches=k, seed=seed, **kw
        )
        for r in range(world)
    ]


def consume(ranks, steps=None):
    """Run all ranks in lockstep for ``steps`` steps (all if None); return the indices seen."""
    seen = []
    iters = [iter(s) for s in ranks]
    count = 0
    while steps is None or count < steps:
        try:
            parts = [next(it) for it in iters]
        except StopIteration:
            break
        for p in parts:
            seen.extend(p)
        count += 1
    return seen


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("k", [1, 2])
def test_exactly_once_per_epoch(world, k):
    n, gbs = 96, 8 * world * k // np.gcd(8, world * k)
    ranks = samplers(n, gbs, world, k=k)
    for epoch in range(3):
        seen = consume(ranks)
        kept = n - (n % gbs if (n % gbs) % (world * k) else 0)
        assert sorted(seen) == sorted(ranks[0].global_order(epoch)[:kept].tolist())
        assert len(seen) == len(set(seen)) == kept
        assert all(s.epoch == epoch + 1 and s.cursor == 0 for s in ranks)
    assert ranks[0].global_order(0).tolist() != ranks[0].global_order(1).tolist()  # reshuffled per epoch


@pytest.mark.parametrize(
    "n,gbs,world,k,drop",
    [
        (96, 16, 2, 1, False),
        (100, 16, 2, 2, False),
        (100, 16, 4, 1, True),
        (102, 12, 3, 2, False),
        (20, 8, 2, 1, False),
    ],
)
@pytest.mark.parametrize("shuffle", [True, False])
def test_same_batches_as_distributed_batches(n, gbs, world, k, drop, shuffle):
    data = torch.arange(n)
    for rank in range(world):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            old = DistributedBatches(
                data,
                global_batch_size=gbs,
                data_parallel_size=world,
                data_index=rank,
                shuffle=shuffle,
                seed=7,
                drop_remainder=drop,
                micro_batches=k,
            )
            new = GlobalBatchSampler(
                n,
                global_batch_size=gbs,
                data_parallel_size=world,
                data_index=rank,
                micro_batches=k,
                shuffle=shuffle,
                seed=7,
                drop_remainder=drop,
            )
        assert len(new) == len(old) == new.steps_per_epoch
        for epoch in range(2):
            expected = [[t[0].tolist() for t in step] for step in old.iter_steps()]
            assert list(new.iter_steps()) == expected, (rank, epoch)


def test_remainder_warning_and_errors():
    with pytest.warns(UserWarning, match="cannot be split evenly"):
        GlobalBatchSampler(10, global_batch_size=4, data_parallel_size=4, data_index=0)
    with pytest.raises(ValueError, match="Received: global_batch_size=6"):
        GlobalBatchSampler(10, global_batch_size=6, data_parallel_size=4, data_index=0)
    with pytest.raises(ValueError, match="Received: data_index=2"):
        GlobalBatchSampler(10, global_batch_size=4, data_parallel_size=2, data_index=2)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalBatchSampler(3, global_batch_size=4, data_parallel_size=1, data_index=0, drop_remainder=True)
    s = GlobalBatchSampler(16, global_batch_size=4, data_parallel_size=1, data_index=0)
    with pytest.raises(ValueError, match="num_samples"):
        s.load_state_dict({**s.state_dict(), "num_samples": 17})
    with pytest.raises(ValueError, match="Received: cursor=99"):
        s.load_state_dict({**s.state_dict(), "cursor": 99})


def test_state_round_trip_and_set_epoch():
    a = GlobalBatchSampler(64, global_batch_size=8, data_parallel_size=2, data_index=1, seed=5)
    it = iter(a)
    first = [next(it) for _ in range(3)]
    state = a.state_dict()
    assert state["epoch"] == 0 and state["cursor"] == 24 and state["seed"] == 5 and state["global_batch_size"] == 8
    rest = list(it)
    b = GlobalBatchSampler(64, global_batch_size=8, data_parallel_size=2, data_index=1, seed=0)
    b.load_state_dict(state)
    assert b.seed == 5 and list(b) == rest and b.state_dict() == a.state_dict()
    assert len(first) + len(rest) == 8
    # set_epoch on the current epoch keeps the cursor (a resumed loop calls it); another epoch restarts.
    b.load_state_dict(state)
    b.set_epoch(0)
    assert b.cursor == 24
    b.set_epoch(2)
    assert b.cursor == 0 and len(b) == 8
    b.set_epoch(2, cursor=0)
    # a state saved after the last step of an epoch resumes at the next epoch
    b.load_state_dict({**state, "cursor": 64})
    assert (b.epoch, b.cursor) == (1, 0)


def test_abandoned_pass_continues_from_cursor():
    s = GlobalBatchSampler(32, global_batch_size=4, data_parallel_size=1, data_index=0, seed=1)
    it = iter(s)
    head = [next(it) for _ in range(3)]
    del it
    tail = list(s)
    assert sorted(i for b in head + tail for i in b) == list(range(32)) and s.epoch == 1


@pytest.mark.parametrize("old_world,new_world", [(1, 2), (2, 4), (4, 2), (2, 1), (4, 1), (3, 2)])
@pytest.mark.parametrize("n", [96, 100])
def test_resume_at_every_cursor_on_another_world_size(old_world, new_world, n):
    gbs = 12  # a multiple of every world size tested
    total_steps = GlobalBatchSampler(n, global_batch_size=gbs, data_parallel_size=1, data_index=0).steps_per_epoch
    for epoch in (0, 1):
        for stop_after in range(total_steps + 1):
            before = samplers(n, gbs, old_world, seed=11)
            for s in before:
                s.set_epoch(epoch)
            seen = consume(before, steps=stop_after)
            state = before[0].state_dict()
            assert all(s.state_dict() == {**state, "data_parallel_size": old_world} for s in before)
            after = samplers(n, gbs, new_world, seed=0)
            for s in after:
                s.load_state_dict(state)
                s.set_epoch(state["epoch"])  # what a training loop does at the top of the epoch: must not reset
            finished_before = state["epoch"] == epoch + 1
            if not finished_before:
                seen += consume(after)
            assert all((s.epoch, s.cursor) == (epoch + 1, 0) for s in after)
            # The tail (n % gbs) is kept when it splits over the world size that reaches it.
            tail = n % gbs
            world_at_tail = old_world if finished_before else new_world
            kept = n - tail if tail % world_at_tail else n
            assert len(seen) == len(set(seen)), (epoch, stop_after)
            assert sorted(seen) == sorted(before[0].global_order(epoch)[:kept].tolist()), (epoch, stop_after)


@pytest.mark.parametrize(
    "n,gbs,world,k,drop",
    [
        (96, 16, 2, 1, False),
        (100, 16, 2, 2, False),
        (100, 16, 4, 1, True),
        (102, 12, 3, 2, False),
        (20, 8, 2, 1, False),
        (7, 8, 2, 1, False),
    ],
)
def test_end_of_epoch_is_found_without_listing_the_rest_of_it(n, gbs, world, k, drop):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampler = GlobalBatchSampler(
            n, global_batch_size=gbs, data_parallel_size=world, data_index=0, micro_batches=k, drop_remainder=drop
        )
    for cursor in range(n + 1):  # the O(1) check advance() uses agrees with the full listing
        assert sampler._has_step_from(cursor) == bool(sampler.global_batches(cursor=cursor)), cursor


def test_a_long_epoch_costs_time_linear_in_its_steps():
    # 100k steps; listing the rest of the epoch after each step (as advance() did) took minutes
    long = GlobalBatchSampler(6_400_000, global_batch_size=64, data_parallel_size=1, data_index=0, shuffle=False)
    steps = sum(1 for _ in zip(range(100_000), long.iter_steps()))
    assert steps == 100_000 and (long.epoch, long.cursor) == (1, 0)  # the whole epoch, then the next one
