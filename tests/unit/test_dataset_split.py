"""DistributedBatches: global batches split over the batch axis, built directly (no process group)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from trainmesh.distribution.dataset import DistributedBatches, as_dataset

pytestmark = pytest.mark.timeout(60)


def make(data, gbs, dp=1, idx=0, *, shuffle=False, seed=0, drop=False, **kw):
    return DistributedBatches(
        data,
        global_batch_size=gbs,
        data_parallel_size=dp,
        data_index=idx,
        shuffle=shuffle,
        seed=seed,
        drop_remainder=drop,
        **kw,
    )


def values(batches) -> list[list[int]]:
    """Sample ids of each local batch (datasets below carry the sample id in tensor 0)."""
    return [b[0].reshape(len(b[0]), -1)[:, 0].tolist() for b in batches]


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# (n samples, global batch, data-parallel size); the remainders 0, 12 and 4 all split evenly
EVEN_CASES = [(64, 16, 4), (60, 16, 4), (20, 8, 2), (24, 24, 8), (6, 8, 2)]


@pytest.mark.parametrize("n,gbs,dp", EVEN_CASES)
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_exactly_once_per_epoch(n, gbs, dp, shuffle, no_warnings):
    data = torch.arange(n)
    seen = []
    for idx in range(dp):
        b = make(data, gbs, dp, idx, shuffle=shuffle, seed=7)
        batches = values(b)
        assert len(batches) == len(b)
        seen += [s for batch in batches for s in batch]
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("n,gbs,dp", EVEN_CASES)
@pytest.mark.parametrize("shuffle", [False, True])
def test_union_of_local_slices_is_the_single_process_global_batch(n, gbs, dp, shuffle):
    data = torch.arange(n)
    single = make(data, gbs, shuffle=shuffle, seed=3)
    parts = [make(data, gbs, dp, idx, shuffle=shuffle, seed=3) for idx in range(dp)]
    for _epoch in range(2):  # and the next epoch's reshuffle agrees too
        global_batches = values(single)
        local = [values(p) for p in parts]
        assert all(len(loc) == len(global_batches) for loc in local)
        for step, global_batch in enumerate(global_batches):
            joined = [s for idx in range(dp) for s in local[idx][step]]
            assert joined == global_batch
            assert len({len(local[idx][step]) for idx in range(dp)}) == 1  # equal local batches


def test_same_data_index_gets_the_same_samples():
    data = torch.arange(64)
    a = make(data, 16, 4, 2, shuffle=True, seed=11)
    b = make(data, 16, 4, 2, shuffle=True, seed=11)
    for _ in range(3):
        assert values(a) == values(b)
    other = make(data, 16, 4, 1, shuffle=True, seed=11)
    assert not set(sum(values(other), [])) & set(sum(values(make(data, 16, 4, 2, shuffle=True, seed=11)), []))


def test_local_batch_size():
    b = make(torch.arange(64), 16, 4, 3)
    assert b.local_batch_size == 4
    assert [len(x) for x in values(b)] == [4, 4, 4, 4]
    assert values(b)[0] == [12, 13, 14, 15]


def test_no_shuffle_keeps_dataset_order_every_epoch():
    b = make(torch.arange(12), 4, 2, 1)
    first = values(b)
    assert first == [[2, 3], [6, 7], [10, 11]]
    assert values(b) == first


def test_shuffle_differs_per_epoch_but_not_across_data_indices():
    data = torch.arange(64)
    parts = [make(data, 16, 4, idx, shuffle=True, seed=5) for idx in range(4)]
    epochs = []
    for epoch in range(3):
        assert all(p.epoch == epoch for p in parts)
        local = [values(p) for p in parts]
        assert all(p.epoch == epoch + 1 for p in parts)
        global_order = [s for step in range(4) for idx in range(4) for s in local[idx][step]]
        assert sorted(global_order) == list(range(64))
        epochs.append(global_order)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]
    assert epochs[0] != list(range(64))


def test_shuffle_depends_on_seed():
    data = torch.arange(64)
    assert values(make(data, 16, shuffle=True, seed=1)) != values(make(data, 16, shuffle=True, seed=2))
    assert values(make(data, 16, shuffle=True, seed=1)) == values(make(data, 16, shuffle=True, seed=1))


def test_set_epoch():
    data = torch.arange(64)
    walked = make(data, 16, 4, 1, shuffle=True, seed=9)
    for _ in range(3):
        list(walked)
    jumped = make(data, 16, 4, 1, shuffle=True, seed=9)
    jumped.set_epoch(3)
    assert values(jumped) == values(walked)  # both epoch 3
    assert jumped.epoch == 4
    jumped.set_epoch(0)
    assert values(jumped) == values(make(data, 16, 4, 1, shuffle=True, seed=9))


def test_iter_itself_starts_the_next_epoch():
    data = torch.arange(64)
    b = make(data, 16, shuffle=True, seed=4)
    first, second = iter(b), iter(b)
    assert b.epoch == 2
    ref = make(data, 16, shuffle=True, seed=4)
    ref.set_epoch(1)
    assert values(second) == values(ref)  # created second -> epoch 1, whatever the consumption order
    ref.set_epoch(0)
    assert values(first) == values(ref)


# --- remainder policy ------------------------------------------------------------------------


def test_remainder_policy_is_documented():
    doc = DistributedBatches.__doc__
    assert "drop_remainder" in doc and "warning" in doc and "equal" in doc


def test_even_remainder_is_kept(no_warnings):
    parts = [make(torch.arange(20), 8, 2, idx) for idx in range(2)]
    assert [len(p) for p in parts] == [3, 3]
    assert values(parts[0]) == [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17]]
    assert values(parts[1]) == [[4, 5, 6, 7], [12, 13, 14, 15], [18, 19]]


def test_uneven_remainder_is_dropped_with_a_warning():
    with pytest.warns(UserWarning, match="5"):
        b = make(torch.arange(21), 8, 2, 0)
    assert len(b) == 2
    assert values(b) == [[0, 1, 2, 3], [8, 9, 10, 11]]
    with pytest.warns(UserWarning):
        b1 = make(torch.arange(21), 8, 2, 1, shuffle=True)
    assert len(sum(values(b1), [])) == 8


def test_drop_remainder_drops_even_remainders_silently(no_warnings):
    b = make(torch.arange(20), 8, 2, 0, drop=True)
    assert len(b) == 2 and values(b) == [[0, 1, 2, 3], [8, 9, 10, 11]]
    b = make(torch.arange(21), 8, 2, 0, drop=True)
    assert len(b) == 2


def test_dataset_smaller_than_one_global_batch():
    with pytest.raises(ValueError, match="global batch"):
        make(torch.arange(6), 8, 2, 0, drop=True)
    b = make(torch.arange(6), 8, 2, 1)
    assert values(b) == [[3, 4, 5]]
    with pytest.warns(UserWarning):
        assert len(make(torch.arange(7), 8, 2, 0)) == 0


def test_remainder_with_shuffle_covers_the_shuffled_tail(no_warnings):
    data = torch.arange(20)
    parts = [make(data, 8, 2, idx, shuffle=True, seed=1) for idx in range(2)]
    single = values(make(data, 8, shuffle=True, seed=1))
    local = [values(p) for p in parts]
    assert len(single[-1]) == 4
    assert local[0][-1] + local[1][-1] == single[-1]


# --- inputs ------------------------------------------------------------------------------------


def test_tuple_of_numpy_arrays():
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    y = np.arange(20, dtype=np.int64) * 10
    b = make((x, y), 8, 2, 1)
    batches = list(b)
    assert len(batches) == 3
    bx, by = batches[0]
    assert isinstance(bx, torch.Tensor) and isinstance(by, torch.Tensor)
    assert bx.dtype == torch.float32 and by.dtype == torch.int64
    assert bx.tolist() == [[8.0, 9.0], [10.0, 11.0], [12.0, 13.0], [14.0, 15.0]]
    assert by.tolist() == [40, 50, 60, 70]


def test_tuple_and_list_of_tensors_and_single_arrays():
    x = torch.arange(16).reshape(8, 2)
    y = torch.arange(8)
    for data in [(x, y), [x, y], (x, y.numpy())]:
        bx, by = next(iter(make(data, 4, 2, 1)))
        assert bx.tolist() == [[4, 5], [6, 7]] and by.tolist() == [2, 3]
    (only,) = next(iter(make(y, 4, 2, 0)))
    assert only.tolist() == [0, 1]
    (only,) = next(iter(make(y.numpy(), 4, 2, 1)))
    assert only.tolist() == [2, 3]


class PairDataset(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i), -float(i)]), i * 10


class DictDataset(PairDataset):
    def __getitem__(self, i):
        return {"x": torch.tensor([i]), "y": i}


def test_map_style_dataset_of_tuples_uses_default_collate():
    ds = PairDataset(20)
    assert as_dataset(ds) is ds
    b = make(ds, 8, 2, 1, shuffle=True, seed=2)
    ref = make((torch.stack([ds[i][0] for i in range(20)]), torch.arange(20) * 10), 8, 2, 1, shuffle=True, seed=2)
    got, want = list(b), list(ref)
    assert len(got) == len(want) == 3
    for (gx, gy), (wx, wy) in zip(got, want):
        assert torch.equal(gx, wx)
        assert torch.equal(gy, wy)


def test_map_style_dataset_of_dicts():
    batch = next(iter(make(DictDataset(8), 4, 2, 1)))
    assert batch["x"].tolist() == [[2], [3]] and batch["y"].tolist() == [2, 3]


def test_to_global_hook_is_applied_to_every_batch():
    calls = []
    b = make(torch.arange(8), 4, 2, 0, to_global=lambda batch: calls.append(batch) or "G")
    assert list(b) == ["G", "G"]
    assert [c[0].tolist() for c in calls] == [[0, 1], [4, 5]]


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


@pytest.mark.parametrize(
    "data,error",
    [
        ((torch.arange(8), torch.arange(7)), ValueError),
        ([1, 2, 3, 4], TypeError),
        ((), TypeError),
        ("abcd", TypeError),
        (Stream(), TypeError),
        (None, TypeError),
        ({"x": torch.arange(8)}, TypeError),
    ],
    ids=["length-mismatch", "list-of-ints", "empty-tuple", "string", "iterable-dataset", "none", "dict"],
)
def test_bad_data(data, error):
    with pytest.raises(error):
        make(data, 4, 2, 0)


@pytest.mark.parametrize("dp,idx", [(2, 2), (2, -1), (0, 0), (4, 7)])
def test_bad_data_index(dp, idx):
    with pytest.raises(ValueError, match="data_index|data_parallel_size"):
        make(torch.arange(8), 4, dp, idx)


@pytest.mark.filterwarnings("ignore:The last")
@pytest.mark.parametrize("gbs", [10, 6, 0])
def test_global_batch_must_split_evenly(gbs):
    with pytest.raises(ValueError, match="global_batch_size|global batch"):
        make(torch.arange(20), gbs, 4, 0)
