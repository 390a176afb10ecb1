"""Workers' batches through reused shared-memory slots: the values of every batch held to the end,
arenas that grow with the batch, nested structures, and the fallbacks that keep torch's path."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from trainmesh.data import DataLoader, GlobalBatchSampler

pytestmark = pytest.mark.timeout(120)

Pair = namedtuple("Pair", "image label")


class Varied(torch.utils.data.Dataset):
    """Sample i: a dict with a namedtuple; its image's length grows every 8 samples (one batch)."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        image = torch.full((4 + 3 * (i // 8),), float(i))
        return {"x": Pair(image, i), "half": torch.tensor([i, -i], dtype=torch.float16), "name": f"s{i}"}


def sampler(n=64, gbs=8):
    return GlobalBatchSampler(n, global_batch_size=gbs, data_parallel_size=1, data_index=0, shuffle=False)


def expected(data, indices):
    return torch.utils.data.default_collate([data[i] for i in indices])


def same(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_batches_kept_to_the_end_keep_their_values_across_slot_reuse():
    # 8 batches through 2 workers x 3 slots: every slot is refilled while earlier batches are still
    # held here, so a batch that aliased its slot would read a later batch's numbers.
    data = Varied()
    with DataLoader(data, sampler(), num_workers=2) as loader:
        got = list(loader)
        assert loader._slots.arenas, "no batch came through a slot"
        workers = {worker for worker, *_ in loader._slots.arenas.values()}
    for j, batch in enumerate(got):
        assert same(batch, expected(data, range(8 * j, 8 * j + 8))), f"batch {j}"
    assert workers == {0, 1}
    assert got[-1]["x"].image.shape == (8, 4 + 3 * 7)  # larger than any earlier arena held: grown


def test_second_epoch_and_resume_through_slots():
    data = Varied()
    with DataLoader(data, sampler(), num_workers=2) as loader:
        first = list(loader)
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = loader.state_dict()
        del it
        loader.load_state_dict(state)
        rest = list(loader)
    assert len(first) == 8 and len(rest) == 5
    for j, batch in enumerate(rest, start=3):
        assert same(batch, expected(data, range(8 * j, 8 * j + 8))), f"batch {j}"


def test_workers_started_anew_each_pass_bring_their_own_slots():
    # Non-persistent workers: new processes each pass; the main process drops the previous ones' arenas.
    data = Varied()
    with DataLoader(data, sampler(), num_workers=2, persistent_workers=False) as loader:
        passes = [list(loader) for _ in range(2)]
        pids = {pid for pid, _ in loader._slots.arenas}
    assert len(pids) == 2  # this pass's two workers only
    for got in passes:
        for j, batch in enumerate(got):
            assert same(batch, expected(data, range(8 * j, 8 * j + 8))), f"batch {j}"


def test_slots_are_freed_as_the_main_process_receives_batches():
    data = Varied()
    with DataLoader(data, sampler(), num_workers=2) as loader:
        list(loader)
        assert loader._slots.busy() == 0
        token = loader._slots.token
    from trainmesh.data import batch_slots

    assert token not in batch_slots._LIVE  # closed: the main process's arena mappings are dropped


def test_user_collate_and_no_workers_keep_their_own_path():
    data = Varied()
    with DataLoader(data, sampler(), num_workers=0) as loader:
        assert loader._slots is None
        assert same(next(iter(loader)), expected(data, range(8)))
    collate = torch.utils.data.default_collate
    with DataLoader(data, sampler(), num_workers=1, collate_fn=collate) as loader:
        assert loader._slots is None
        assert same(next(iter(loader)), expected(data, range(8)))


def test_ragged_samples_raise_torchs_error_from_the_worker():
    class Ragged(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.zeros(i + 1)

    with DataLoader(Ragged(), sampler(8, 4), num_workers=1) as loader:
        with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
            next(iter(loader))


class Numbers(torch.utils.data.Dataset):
    """Sample i: an image, and Python numbers of each kind torch's collate turns into a tensor."""

    def __len__(self):
        return 96

    def __getitem__(self, i):
        return torch.full((16,), float(i)), i, i / 4, i % 3 == 0


def test_python_numbers_travel_in_the_slot_with_torchs_dtypes():
    # int -> int64, float -> float64, bool -> bool, as default_collate makes them. A batch through a
    # slot (its image copied out, not shared memory) has its numbers there too, not each tensor in a
    # shared-memory block of its own; a slot's first batch (no arena yet) takes torch's path whole.
    data = Numbers()
    with DataLoader(data, sampler(96, 8), num_workers=2) as loader:
        got = list(loader)
    for j, batch in enumerate(got):
        assert same(batch, expected(data, range(8 * j, 8 * j + 8))), f"batch {j}"
    assert [t.dtype for t in got[-1]] == [torch.float32, torch.int64, torch.float64, torch.bool]
    through_slots = [batch for batch in got if not batch[0].is_shared()]
    assert len(through_slots) >= 6, "fewer batches through slots than expected"
    assert not any(t.is_shared() for batch in through_slots for t in batch[1:])
    assert all(t.is_shared() for t in got[0])  # the first batch: no arena yet, torch's own path


def test_dropped_batches_memory_is_reused_and_anything_still_referring_keeps_its_values():
    data = Numbers()
    kept, pointers = [], set()
    with DataLoader(data, sampler(96, 8), num_workers=2) as loader:
        for j, batch in enumerate(loader):
            pointers.add(batch[0].data_ptr())
            if j % 3 == 0:
                kept.append((j, batch[0][2:5]))  # a view: keeps its batch's memory out of reuse
            elif j % 3 == 1:
                kept.append((j, batch[2].numpy()))  # a numpy array over the float64 labels
            del batch
        pool = loader._slots.outputs
        assert len(pool.storages[8 * 16 * 4]) <= 16
    for j, held in kept:
        whole = expected(data, range(8 * j, 8 * j + 8))
        want = whole[0][2:5] if j % 3 == 0 else whole[2].numpy()
        assert (torch.as_tensor(held) == torch.as_tensor(want)).all(), f"batch {j}"
    # 12 batches, 4 of them held by a view: the 8 others came through memory a dropped batch left
    assert len(pointers) < 12


def test_pinned_batches_do_not_reuse_memory():
    # An asynchronous copy to the GPU may still read a pinned batch after its holder dropped it.
    from trainmesh.data.batch_slots import BatchSlots

    assert BatchSlots(2, 3, pin=True).outputs is None
    assert BatchSlots(2, 3, pin=False).outputs is not None
