"""RowStore: one table's row ranges packed side by side on a server, updated in one step."""

from __future__ import annotations

import pytest
import torch

from trainmesh.ps import row_store
from trainmesh.ps.row_store import RowStore
from trainmesh.ps.shard import Shard

pytestmark = pytest.mark.timeout(60)

ROWS, PER_RANGE, DIM = 166, 16, 4  # 11 ranges, the last one 6 rows
SLOT_BYTES = PER_RANGE * DIM * 4
OPTIMIZERS = [{"name": "sgd", "lr": 0.1, "momentum": 0.9}, {"name": "adam", "lr": 0.01}, {"name": "adagrad", "lr": 0.1}]


def _ranges(optimizer: dict) -> dict[int, Shard]:
    count = -(-ROWS // PER_RANGE)
    return {
        i: Shard.sparse(
            f"t#{i}", min(PER_RANGE, ROWS - i * PER_RANGE), DIM, optimizer, {"kind": "normal", "std": 0.1, "seed": 3}
        )
        for i in range(count)
    }


def _per_range_apply(shards: dict[int, Shard], ids: torch.Tensor, grads: torch.Tensor, lr) -> None:
    """The reference: each touched range updated on its own, as a server did before RowStore."""
    for index in torch.unique(ids // PER_RANGE).tolist():
        mask = ids // PER_RANGE == index
        shards[index].apply_rows(ids[mask] - index * PER_RANGE, grads[mask], lr=lr)


def _storages(store: RowStore) -> set[int]:
    return {t.untyped_storage().data_ptr() for page in store.pages for t in (page.value, *page.state.values())}


@pytest.mark.parametrize("slots_per_page", [4, None], ids=["pages of 4 slots", "one page"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o["name"])
def test_packed_update_equals_one_update_per_range(optimizer, slots_per_page, monkeypatch):
    if slots_per_page:
        monkeypatch.setattr(row_store, "PAGE_BYTES", slots_per_page * SLOT_BYTES)
    packed, reference = _ranges(optimizer), _ranges(optimizer)
    store = RowStore("t", ROWS, PER_RANGE)
    gen = torch.Generator().manual_seed(0)
    # Ranges are first touched out of order and a few at a time, so slots are not in range order and
    # pages are added while ranges are already packed: those must keep their values.
    touches = [[9, 3], [0, 10, 4], [1, 2, 5, 6, 7, 8], list(range(11))]
    for step, ranges in enumerate(touches * 2):
        ids = (
            torch.cat(
                [
                    r * PER_RANGE + torch.randperm(min(PER_RANGE, ROWS - r * PER_RANGE), generator=gen)[:3]
                    for r in ranges
                ]
            )
            .sort()
            .values
        )
        grads = torch.randn(ids.numel(), DIM, generator=gen)
        lr = 0.05 if step == 5 else None
        store.apply(ids, grads, packed.__getitem__, lr=lr)
        _per_range_apply(reference, ids, grads, lr)
    assert [p.value.shape[0] for p in store.pages] == ([4 * PER_RANGE] * 3 if slots_per_page else [11 * PER_RANGE])
    for index, shard in packed.items():
        want = reference[index]
        assert shard.version == want.version > 0
        assert torch.equal(shard.value, want.value), index
        assert all(torch.equal(shard.state[k], want.state[k]) for k in want.state)
        # The shard's tensors are views of its slot: what a snapshot or an export sends is live.
        assert shard.value.untyped_storage().data_ptr() in _storages(store)
        assert all(t.untyped_storage().data_ptr() in _storages(store) for t in shard.state.values())
    ids = torch.tensor([165, 0, 17, 0, 80])
    got, version = store.read(ids, packed.__getitem__)
    assert torch.equal(got, torch.stack([reference[i // PER_RANGE].value[i % PER_RANGE] for i in ids.tolist()]))
    assert version == max(reference[i].version for i in (0, 1, 5, 10))


def test_a_replaced_range_is_packed_again_from_its_new_data():
    """An import or a snapshot restore puts a new Shard in the server's dict: the store must take
    its data, not keep updating the old slot contents."""
    optimizer = {"name": "adam", "lr": 0.01}
    current = _ranges(optimizer)
    store = RowStore("t", ROWS, PER_RANGE)
    ids = torch.tensor([1, 20, 40])
    store.apply(ids, torch.ones(3, DIM), current.__getitem__)
    moved_in = _ranges(optimizer)[1]
    moved_in.value.fill_(7.0)
    moved_in.version = 41
    old = current[1]
    current[1] = moved_in
    store.apply(ids, torch.ones(3, DIM), current.__getitem__)
    reference = _ranges(optimizer)[1]
    reference.value.fill_(7.0)
    reference.apply_rows(torch.tensor([4]), torch.ones(1, DIM))
    assert torch.equal(moved_in.value, reference.value)
    assert moved_in.version == 42 and old.version == 1
    got, version = store.read(torch.tensor([20]), current.__getitem__)
    assert torch.equal(got[0], reference.value[4]) and version == 42


def test_a_forgotten_range_keeps_its_data_and_frees_its_slot():
    optimizer = {"name": "sgd", "lr": 1.0}
    shards = _ranges(optimizer)
    store = RowStore("t", ROWS, PER_RANGE)
    store.apply(torch.tensor([0, 16]), torch.ones(2, DIM), shards.__getitem__)
    leaving = shards[1]
    kept = leaving.value.clone()
    store.forget(1)
    assert leaving.value.untyped_storage().data_ptr() not in _storages(store)
    store.apply(torch.tensor([32]), torch.full((1, DIM), 5.0), shards.__getitem__)  # takes the freed slot
    assert int(store.slot_of_range[2]) == 1
    assert torch.equal(leaving.value, kept)
    assert torch.equal(shards[2].value[0], _ranges(optimizer)[2].value[0] - 5.0)


def test_a_range_that_does_not_fit_the_table_is_refused():
    shards = _ranges({"name": "sgd", "lr": 0.1})
    store = RowStore("t", ROWS, PER_RANGE)
    store.apply(torch.tensor([0]), torch.ones(1, DIM), shards.__getitem__)
    shards[1] = Shard.sparse("t#1", PER_RANGE, DIM, {"name": "adam", "lr": 0.1})
    with pytest.raises(ValueError, match="does not fit table 't'"):
        store.apply(torch.tensor([16]), torch.ones(1, DIM), shards.__getitem__)


def test_with_a_generation_only_new_ranges_are_looked_up_and_a_new_generation_rechecks_all():
    """A server passes its shards generation: while it is unchanged the packed ranges are trusted
    (no lookup per touched range), and after a replacement (a new generation) the new shard's
    data and version are taken, the old shard keeping its own."""
    optimizer = {"name": "sgd", "lr": 1.0}
    current = _ranges(optimizer)
    looked_up: list[int] = []

    def shard_of(index: int) -> Shard:
        looked_up.append(index)
        return current[index]

    store = RowStore("t", ROWS, PER_RANGE)
    ids = torch.tensor([1, 20, 40])
    store.apply(ids, torch.ones(3, DIM), shard_of, generation=0)
    assert sorted(set(looked_up)) == [0, 1, 2]
    looked_up.clear()
    store.apply(torch.tensor([2, 21, 100]), torch.ones(3, DIM), shard_of, generation=0)
    assert looked_up == [6]  # only the range not packed yet
    looked_up.clear()
    assert [current[i].version for i in (0, 1, 2, 6)] == [2, 2, 1, 1]
    old = current[1]
    moved_in = _ranges(optimizer)[1]
    moved_in.value.fill_(7.0)
    moved_in.version = 41
    current[1] = moved_in
    store.apply(ids, torch.ones(3, DIM), shard_of, generation=1)
    assert set(looked_up) == {0, 1, 2, 6}
    assert moved_in.version == 42 and old.version == 2
    assert torch.equal(moved_in.value[4], torch.full((DIM,), 6.0))
    got, version = store.read(torch.tensor([20]), shard_of, 1)
    assert torch.equal(got[0], torch.full((DIM,), 6.0)) and version == 42


def test_versions_survive_a_new_page_and_a_forget(monkeypatch):
    monkeypatch.setattr(row_store, "PAGE_BYTES", 2 * SLOT_BYTES)
    shards = _ranges({"name": "sgd", "lr": 1.0})
    store = RowStore("t", ROWS, PER_RANGE)
    store.apply(torch.tensor([0, 16]), torch.ones(2, DIM), shards.__getitem__)
    store.apply(torch.tensor([0, 32, 48]), torch.ones(3, DIM), shards.__getitem__)  # a second page
    assert len(store.pages) == 2
    assert [shards[i].version for i in range(4)] == [2, 1, 1, 1]
    store.forget(0)
    store.apply(torch.tensor([16, 64]), torch.ones(2, DIM), shards.__getitem__)  # 4 takes 0's slot
    assert [shards[i].version for i in (0, 1, 4)] == [2, 2, 1]


def test_ids_in_any_order_update_each_touched_range_once():
    # A push's ids arrive increasing (the touched slots are then read off the runs of ranges);
    # ids in any other order take the general path. Both must advance each range's version once
    # and update the same rows as one update per range.
    packed, reference = _ranges(OPTIMIZERS[1]), _ranges(OPTIMIZERS[1])
    store = RowStore("t", ROWS, PER_RANGE)
    gen = torch.Generator().manual_seed(1)
    for ids in (torch.tensor([3, 40, 41, 165, 17, 5]), torch.tensor([0, 1, 2, 16, 80, 81, 160, 165])):
        grads = torch.randn(ids.numel(), DIM, generator=gen)
        store.apply(ids, grads, packed.__getitem__)
        _per_range_apply(reference, ids, grads, None)
    for index, shard in packed.items():
        assert shard.version == reference[index].version, index
        assert torch.equal(shard.value, reference[index].value), index
    assert [packed[i].version for i in (0, 1, 2, 5, 10)] == [2, 2, 1, 1, 2]
