"""The Trainer's per-step micro-batches from in-memory tensors: each process's rows of each global
batch, in the sampler's order; unshuffled, views of the data (no copy)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trainmesh.data import GlobalBatchSampler
from trainmesh.trainer.data_input import TrainSteps

pytestmark = pytest.mark.timeout(60)


def _distribution(dp: int, index: int):
    return SimpleNamespace(
        data_parallel_size=dp,
        auto_shard_dataset=True,
        data_index=lambda: index,
        _batch_to_global=lambda batch, device=None: batch,
    )


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("dp,k", [(1, 1), (2, 2), (4, 1)])
def test_each_process_gets_its_rows_of_every_global_batch(shuffle, dp, k):
    x = torch.arange(96, dtype=torch.float32).reshape(48, 2)
    y = torch.arange(48)
    for index in range(dp):
        steps = TrainSteps(
            (x, y),
            _distribution(dp, index),
            global_batch_size=16,
            grad_accum_steps=k,
            shuffle=shuffle,
            seed=3,
            drop_remainder=False,
        )
        expected = GlobalBatchSampler(
            48, global_batch_size=16, data_parallel_size=dp, data_index=index, micro_batches=k, shuffle=shuffle, seed=3
        ).plan()
        got = list(steps)
        assert len(got) == len(expected) == 3
        for micro_batches, (_, indices) in zip(got, expected):
            assert len(micro_batches) == k
            for (xb, yb), rows in zip(micro_batches, indices):
                assert yb.tolist() == [int(i) for i in rows]
                assert torch.equal(xb, x[torch.as_tensor(rows)])
                if not shuffle:  # a view of the data, not a copy
                    assert xb.data_ptr() == x[int(rows[0])].data_ptr() and yb._base is y


def test_the_unshuffled_fast_path_follows_a_resumed_cursor():
    x, y = torch.arange(48, dtype=torch.float32).reshape(24, 2), torch.arange(24)
    steps = TrainSteps(
        (x, y),
        _distribution(2, 1),
        global_batch_size=8,
        grad_accum_steps=1,
        shuffle=False,
        seed=0,
        drop_remainder=False,
    )
    steps.load_state_dict({**steps.state_dict(), "cursor": 8})
    assert [mb[0][1].tolist() for mb in steps] == [[12, 13, 14, 15], [20, 21, 22, 23]]
    assert np.array_equal(np.asarray(steps.last_indices), [20, 21, 22, 23])


@pytest.mark.parametrize("shuffle", [False, True])
def test_distributed_batches_hand_out_the_sampler_rows_as_views_when_unshuffled(shuffle):
    from trainmesh.distribution.dataset import DistributedBatches

    x, y = torch.arange(64, dtype=torch.float32).reshape(32, 2), torch.arange(32)
    for index in range(2):
        batches = DistributedBatches(
            (x, y),
            global_batch_size=8,
            data_parallel_size=2,
            data_index=index,
            shuffle=shuffle,
            seed=5,
            drop_remainder=False,
        )
        expected = [np.concatenate(m) for _, m in batches.sampler.local_steps(0)]
        got = list(batches)
        assert [yb.tolist() for _, yb in got] == [e.tolist() for e in expected]
        assert all((yb._base is y) == (not shuffle) for _, yb in got)
