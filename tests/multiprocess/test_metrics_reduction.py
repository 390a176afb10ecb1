"""Summing metric states over real gloo ranks gives the one-process value exactly.

37 samples are cut into uneven contiguous shards (one rank gets 2 samples, or none).
Each rank updates its metrics batch by batch, all-reduces ``metric.state()`` with SUM
and calls ``compute(state)``. The result must equal a one-process pass over all 37
samples bit for bit, while the mean of the per-rank accuracies must not (with uneven
shards it weights a 2-sample rank like a 20-sample one), so the test proves its point.
"""

from __future__ import annotations

import pytest
import torch

from trainmesh.testing import run_distributed
from trainmesh.trainer.metrics import Accuracy, Mean

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

N_SAMPLES, N_CLASSES, BATCH = 37, 3, 4
SHARDS = {  # world size -> per-rank sample counts: uneven, then with empty ranks
    2: ([30, 7], [37, 0]),
    4: ([20, 10, 5, 2], [25, 12, 0, 0]),
}


def make_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    outputs = torch.randn(N_SAMPLES, N_CLASSES, generator=generator)
    targets = torch.randint(0, N_CLASSES, (N_SAMPLES,), generator=generator)
    # Multiples of 1/8: every partial sum is exact in float64, so Mean must match bit for bit too.
    values = torch.randint(0, 80, (N_SAMPLES,), generator=generator).double() / 8
    return outputs, targets, values


def _local_metrics(sizes: list[int], rank: int) -> tuple[Accuracy, Mean]:
    outputs, targets, values = make_data()
    start = sum(sizes[:rank])
    stop = start + sizes[rank]
    acc, mean = Accuracy(), Mean("value")
    for lo in range(start, stop, BATCH):
        hi = min(lo + BATCH, stop)
        acc.update(outputs[lo:hi], targets[lo:hi])
        mean.update(values[lo:hi])
    return acc, mean


def reduce_metrics(shardings: tuple[list[int], ...]) -> list[dict]:
    """Runs on every rank: local metrics per sharding, then the SUM-reduced results."""
    import torch.distributed as dist

    rank = dist.get_rank()
    results = []
    for sizes in shardings:
        assert len(sizes) == dist.get_world_size() and sum(sizes) == N_SAMPLES
        acc, mean = _local_metrics(sizes, rank)
        acc_state, mean_state = acc.state(), mean.state()
        dist.all_reduce(acc_state, op=dist.ReduceOp.SUM)
        dist.all_reduce(mean_state, op=dist.ReduceOp.SUM)
        results.append(
            dict(
                local_accuracy=acc.compute(),
                local_count=int(acc.state()[1]),
                accuracy=acc.compute(acc_state),
                mean=mean.compute(mean_state),
                state_dtype=str(acc_state.dtype),
            )
        )
    return results


def single_process() -> tuple[float, float, int]:
    outputs, targets, values = make_data()
    acc, mean = Accuracy(), Mean()
    acc.update(outputs, targets)
    mean.update(values)
    correct = int((outputs.argmax(-1) == targets).sum())
    return acc.compute(), mean.compute(), correct


@pytest.mark.parametrize("world_size", sorted(SHARDS))
def test_reduced_state_equals_one_process_exactly(world_size):
    expected_acc, expected_mean, correct = single_process()
    assert expected_acc == correct / N_SAMPLES
    assert 0 < correct < N_SAMPLES  # a data set all right or all wrong would prove nothing

    per_rank = run_distributed(reduce_metrics, world_size, args=(SHARDS[world_size],), timeout=100)

    for sharding_index, sizes in enumerate(SHARDS[world_size]):
        results = [rank_results[sharding_index] for rank_results in per_rank]
        assert [r["local_count"] for r in results] == sizes
        for r in results:
            assert r["state_dtype"] == "torch.float64"
            assert r["accuracy"] == expected_acc  # exact, on every rank
            assert r["mean"] == expected_mean

    # The naive alternative is wrong on the uneven sharding: that is why state is reduced.
    uneven = [rank_results[0] for rank_results in per_rank]
    mean_of_local = sum(r["local_accuracy"] for r in uneven) / world_size
    assert abs(mean_of_local - expected_acc) > 1e-3
