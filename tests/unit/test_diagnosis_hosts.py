"""The hang diagnosis names a lost host: every rank of one host missing vs a single slow rank.

A dict stands in for the job's c10d store (the same set/get/check calls); the real thing
across network-namespace hosts is in tests/multihost/test_host_failure.py.
"""

from __future__ import annotations

import time

import pytest

from trainmesh.comm.diagnosis import CollectiveTimeoutError, ProgressBeacon, host_identity

pytestmark = [pytest.mark.timeout(30), pytest.mark.xdist_group("serial")]


class DictStore:
    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


@pytest.fixture
def job():
    """``job(hosts)`` -> (store, {rank: beacon}); every beacon's writer is stopped afterwards."""
    made = []

    def make(hosts: dict[int, str]):
        store = DictStore()
        beacons = {rank: ProgressBeacon(store=store, rank=rank, world_size=4) for rank in hosts}
        made.extend(beacons.values())
        for rank, address in hosts.items():
            store.set(f"trainmesh/host/{rank}", f"{address}|box{address[-1]}|{rank // 2}")
        return store, beacons

    yield make
    for b in made:
        b.close()


def test_all_ranks_of_one_host_missing_names_that_host(job):
    _, beacons = job({0: "10.0.0.1", 1: "10.0.0.1", 2: "10.0.0.2", 3: "10.0.0.2"})
    for rank in range(4):
        beacons[rank].mark(5)
    beacons[0].mark(6, "all-reduce")
    beacons[1].mark(6, "all-reduce")
    error = beacons[0].diagnose(RuntimeError("Connection closed by peer [10.0.0.2]:1234"))
    assert isinstance(error, CollectiveTimeoutError)
    assert error.missing_ranks == [2, 3] and error.lost_hosts == {"10.0.0.2": [2, 3]}
    assert "Lost: host 10.0.0.2 (node 1, host name 'box2'): ranks [2, 3]." in str(error)


def test_one_slow_rank_is_not_a_lost_host(job):
    _, beacons = job({0: "10.0.0.1", 1: "10.0.0.1", 2: "10.0.0.2", 3: "10.0.0.2"})
    for rank in range(4):
        beacons[rank].mark(5)
    for rank in (0, 1, 2):
        beacons[rank].mark(6)
    error = beacons[0].diagnose(RuntimeError("timed out"))
    assert error.missing_ranks == [3] and error.lost_hosts == {}
    assert "Lost:" not in str(error)


def test_host_identity_reads_the_launcher_variables():
    address, name, node = host_identity({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "GROUP_RANK": "3"})
    assert address == "127.0.0.1" and node == 3 and name
    assert host_identity({"RANK": "5", "LOCAL_WORLD_SIZE": "2"})[::2] == ("?", 2)


class SlowStore(DictStore):
    """A store a round trip away: every write takes 50 ms."""

    def __init__(self):
        super().__init__()
        self.progress_writes = 0

    def set(self, key, value):
        time.sleep(0.05)
        self.progress_writes += key.startswith("trainmesh/progress/")
        super().set(key, value)


def test_marks_do_not_wait_for_the_store_and_the_newest_note_is_written():
    store = SlowStore()
    b = ProgressBeacon(store=store, rank=0, world_size=2)
    started = time.perf_counter()
    for step in range(1, 201):  # 200 short steps: written one by one, 10 s of store round trips
        b.mark(step, "forward/backward")
    assert time.perf_counter() - started < 0.5
    b.close()
    assert store.get("trainmesh/progress/0").decode().startswith("200|forward/backward|")
    assert 1 <= store.progress_writes <= 5  # only the newest note of each write interval
