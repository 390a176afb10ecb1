"""tm.data.DataLoader: same batches as direct indexing, read-ahead, retries, corrupt samples, cache, resume."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from trainmesh.data import CorruptSampleError, DataLoader, GlobalBatchSampler

pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("serial")]


class Squares(torch.utils.data.Dataset):
    """Sample i is (i, i*i); optionally slow, flaky, corrupt, and logging every read to a directory."""

    def __init__(self, n=40, delay=0.0, flaky=(), corrupt=(), log_dir=None):
        self.n, self.delay, self.flaky, self.corrupt, self.log_dir = n, delay, set(flaky), set(corrupt), log_dir

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.log_dir:  # a file per read works across worker processes
            open(os.path.join(self.log_dir, f"{i}-{time.monotonic_ns()}-{os.getpid()}"), "w").close()
        if self.delay:
            time.sleep(self.delay)
        if i in self.corrupt:
            raise ValueError("bad header")
        if i in self.flaky and self._failures(i) < 2:
            raise OSError("transient")
        return torch.tensor(float(i)), torch.tensor(float(i * i))

    def _failures(self, i):  # fail twice per index, counted in a file so workers share the count
        path = os.path.join(self.log_dir, f"flaky-{i}")
        count = int(open(path).read()) if os.path.exists(path) else 0
        with open(path, "w") as fh:
            fh.write(str(count + 1))
        return count

    def __repr__(self):
        return f"Squares(n={self.n})"


def reads(log_dir):
    return sorted(int(name.split("-")[0]) for name in os.listdir(log_dir) if not name.startswith("flaky"))


def sampler(n=40, gbs=8, world=1, index=0, k=1, **kw):
    return GlobalBatchSampler(
        n,
        global_batch_size=gbs,
        data_parallel_size=world,
        data_index=index,
        micro_batches=k,
        seed=kw.pop("seed", 2),
        **kw,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_same_batches_as_direct_indexing(num_workers, prefetch):
    data = Squares()
    s = sampler(world=2, index=1, k=2)
    expected = [
        [torch.utils.data.default_collate([data[i] for i in m]) for m in step]
        for step in sampler(world=2, index=1, k=2).iter_steps()
    ]
    with DataLoader(data, s, num_workers=num_workers, prefetch=prefetch) as loader:
        for epoch in range(2):
            got = list(loader)
            assert len(got) == len(expected) == 5
            for g, e in zip(got, expected):
                assert len(g) == 2 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(g, e))
            assert s.epoch == epoch + 1 and loader.stats.steps == 5 * (epoch + 1)
            ref = sampler(world=2, index=1, k=2)
            ref.set_epoch(epoch + 1)
            expected = [
                [torch.utils.data.default_collate([data[i] for i in m]) for m in step] for step in ref.iter_steps()
            ]
        assert loader.stats.samples == 2 * 20 and loader.stats.batches == 20


def test_plain_index_batches_and_torch_batch_sampler():
    data = Squares(10)
    batches = [[0, 1, 2], [3, 4], [9]]
    with DataLoader(data, batches) as loader:
        assert [b[0].tolist() for b in loader] == [[0.0, 1.0, 2.0], [3.0, 4.0], [9.0]]
    bs = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(10)), batch_size=4, drop_last=False)
    with DataLoader(data, bs, prefetch=1) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        assert state == {"epoch": 0, "consumed_batches": 1}
        del it
        assert [b[0].tolist() for b in loader] == [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]


class SignalsNextBatch(Squares):
    """Sets an event when a sample of the second batch (index >= first_of_next) is read."""

    def __init__(self, n, first_of_next):
        super().__init__(n)
        self.first_of_next, self.next_batch_read = first_of_next, threading.Event()

    def __getitem__(self, i):
        if i >= self.first_of_next:
            self.next_batch_read.set()
        return super().__getitem__(i)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_prefetch_reads_the_next_batch_while_the_step_runs(prefetch):
    # Ordered by events, not timed: while the step holds batch 0, a prefetching loader reads batch 1 in the
    # background; a loader without prefetch reads nothing until the step asks. (A timed version of this test
    # failed under load: overlap is a speed figure, which lives in benchmarks/dataloader.py.)
    data = SignalsNextBatch(16, first_of_next=4)
    with DataLoader(data, sampler(n=16, gbs=4, shuffle=False), prefetch=prefetch) as loader:
        it = iter(loader)
        first = next(it)
        assert first[0].tolist() == [0.0, 1.0, 2.0, 3.0]
        if prefetch:
            assert data.next_batch_read.wait(timeout=60), "the prefetch thread never read batch 1"
        else:
            assert not data.next_batch_read.wait(timeout=0.3), "batch 1 was read before the step asked for it"
        assert [b[0].tolist() for b in it] == [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0], [12.0, 13.0, 14.0, 15.0]]
        assert data.next_batch_read.is_set()


def test_transient_errors_are_retried(tmp_path):
    data = Squares(8, flaky={3, 5}, log_dir=str(tmp_path))
    with DataLoader(data, sampler(n=8, gbs=4, shuffle=False), retry_delay=0.001, max_retries=3) as loader:
        got = [b[0].tolist() for b in loader]
    assert got == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    assert loader.stats.retries == 4 and loader.stats.skipped == 0


def test_retries_exhausted_raise_naming_the_sample(tmp_path):
    data = Squares(8, flaky={5}, log_dir=str(tmp_path))
    with DataLoader(data, sampler(n=8, gbs=4, shuffle=False), retry_delay=0.001, max_retries=1) as loader:
        with pytest.raises(CorruptSampleError, match=r"sample 5 of Squares\(n=8\) failed: OSError after 1 retries"):
            list(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_corrupt_sample_raises_or_is_skipped(num_workers):
    data = Squares(16, corrupt={6})
    with DataLoader(data, sampler(n=16, gbs=4, shuffle=False), num_workers=num_workers) as loader:
        with pytest.raises(
            CorruptSampleError, match=r"sample 6 of Squares\(n=16\) failed: ValueError: bad header"
        ) as err:
            list(loader)
        assert err.value.index == 6
    with DataLoader(data, sampler(n=16, gbs=4, shuffle=False), num_workers=num_workers, on_corrupt="skip") as loader:
        got = [b[0].tolist() for b in loader]
    assert got[1] == [4.0, 5.0, 7.0] and len(got) == 4
    assert loader.stats.skipped == 1 and loader.stats.samples == 15


@pytest.mark.parametrize("num_workers", [0, 2])
def test_cache_avoids_second_reads(tmp_path, num_workers):
    data = Squares(16, corrupt={2}, log_dir=str(tmp_path))
    with DataLoader(data, sampler(n=16, gbs=4), cache=True, num_workers=num_workers, on_corrupt="skip") as loader:
        first = [b[0].tolist() for b in loader]
        assert reads(tmp_path) == list(range(16))
        second = [b[0].tolist() for b in loader]
        assert reads(tmp_path) == list(range(16))  # no read in the second epoch
        assert loader.stats.cache_hits == 15 and loader.stats.skipped == 2
    assert sorted(sum(first, [])) == sorted(sum(second, [])) and first != second  # reshuffled


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_through_loader_state(num_workers):
    data = Squares(48)
    with DataLoader(data, sampler(n=48, gbs=8), num_workers=num_workers, prefetch=3) as loader:
        full = [b[0].tolist() for b in loader]
    with DataLoader(data, sampler(n=48, gbs=8), num_workers=num_workers, prefetch=3) as loader:
        it = iter(loader)
        head = [next(it)[0].tolist() for _ in range(2)]
        time.sleep(0.05)  # let the thread read ahead: the state must not count read-ahead
        state = loader.state_dict()
    assert state["cursor"] == 16 and state["epoch"] == 0
    with DataLoader(data, sampler(n=48, gbs=8, seed=99), num_workers=num_workers) as resumed:
        resumed.load_state_dict(state)
        tail = [b[0].tolist() for b in resumed]
    assert head + tail == full


def test_close_stops_the_thread_and_workers():
    before = {t.name for t in threading.enumerate()}
    loader = DataLoader(Squares(64), sampler(n=64, gbs=4), num_workers=2, prefetch=2)
    it = iter(loader)
    next(it)
    workers = loader._torch_loader._iterator._workers
    assert any(t.name == "trainmesh-prefetch" for t in threading.enumerate())
    loader.close()
    loader.close()  # idempotent
    assert not any(t.name == "trainmesh-prefetch" for t in threading.enumerate() if t.name not in before)
    assert all(not w.is_alive() for w in workers)
    with pytest.raises(RuntimeError, match="closed"):
        next(iter(loader))


def test_validation_errors():
    with pytest.raises(ValueError, match="Received: on_corrupt='ignore'"):
        DataLoader(Squares(), sampler(), on_corrupt="ignore")
    with pytest.raises(ValueError, match="Received: pin_memory='yes'"):
        DataLoader(Squares(), sampler(), pin_memory="yes")
