"""The hang diagnosis names a lost host: every rank of one host missing vs a single slow rank.

A dict stands in for the job's c10d store (the same set/get/check calls); the real thing
across network-namespace hosts is in tests/multihost/test_host_failure.py.
"""

from __future__ import annotations

import pytest

from trainmesh.comm.diagnosis import CollectiveTimeoutError, ProgressBeacon, host_identity

pytestmark = pytest.mark.timeout(30)


class DictStore:
    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def beacon(store, rank, world_size=4) -> ProgressBeacon:
    b = ProgressBeacon.__new__(ProgressBeacon)
    b.enabled, b.store, b.rank, b.world_size = True, store, rank, world_size
    b.step, b.phase, b.since = -1, "start", 0.0
    return b


def job(hosts: dict[int, str]):
    store = DictStore()
    beacons = {rank: beacon(store, rank) for rank in hosts}
    for rank, address in hosts.items():
        store.set(f"trainmesh/host/{rank}", f"{address}|box{address[-1]}|{rank // 2}")
    return store, beacons


def test_all_ranks_of_one_host_missing_names_that_host():
    _, beacons = job({0: "10.0.0.1", 1: "10.0.0.1", 2: "10.0.0.2", 3: "10.0.0.2"})
    for rank in range(4):
        beacons[rank].mark(5)
    beacons[0].mark(6, "all-reduce")
    beacons[1].mark(6, "all-reduce")
    error = beacons[0].diagnose(RuntimeError("Connection closed by peer [10.0.0.2]:1234"))
    assert isinstance(error, CollectiveTimeoutError)
    assert error.missing_ranks == [2, 3] and error.lost_hosts == {"10.0.0.2": [2, 3]}
    assert "Lost: host 10.0.0.2 (node 1, host name 'box2'): ranks [2, 3]." in str(error)


def test_one_slow_rank_is_not_a_lost_host():
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
