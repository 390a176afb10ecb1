"""ClockTable: the SSP gate, liveness and the sync dead-worker error, on a fake clock."""

from __future__ import annotations

import math

import pytest

from trainmesh.ps.clock import ClockTable

pytestmark = pytest.mark.timeout(30)


class FakeTime:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_ssp_gate_waits_for_the_slowest_live_worker():
    t = FakeTime()
    table = ClockTable(num_workers=3, dead_after_s=10, time_fn=t)
    for w in "012":
        table.seen(w, 0)
    table.seen("0", 3)
    assert not table.gate(3, staleness=2, sync=False, drop_dead_workers=False).ready  # needs min >= 1
    table.seen("1", 1)
    assert not table.gate(3, 2, False, False).ready  # worker 2 still at 0
    table.seen("2", 1)
    assert table.gate(3, 2, False, False).ready
    table.record_answered(3)
    assert table.max_lead == 2
    assert table.gate(1, 0, True, False).ready and not table.gate(2, 0, True, False).ready


def test_clock_never_moves_backwards_and_async_never_waits():
    t = FakeTime()
    table = ClockTable(num_workers=2, time_fn=t)
    table.seen("0", 5)
    table.seen("0", 2)
    assert table.workers["0"].clock == 5
    assert table.gate(1000, math.inf, False, False).ready


def test_dead_worker_leaves_min_clock_for_ssp_but_is_named_for_sync():
    t = FakeTime()
    table = ClockTable(num_workers=2, dead_after_s=10, time_fn=t)
    table.seen("0", 4)
    table.seen("1", 1)
    t.now += 5
    table.seen("0", 4)
    assert not table.gate(4, 1, False, False).ready
    t.now += 6  # worker 1 silent for 11 s
    assert not table.is_live("1") and table.is_live("0")
    assert table.gate(4, 1, sync=False, drop_dead_workers=False).ready
    decision = table.gate(4, 0, sync=True, drop_dead_workers=False)
    assert not decision.ready and decision.dead_worker == "1"
    assert decision.error.startswith("sync: worker 1 sent no heartbeat for 11.0s")
    assert table.gate(4, 0, sync=True, drop_dead_workers=True).ready
    table.seen("1")  # a heartbeat revives it, and it holds the gate again
    assert not table.gate(4, 0, True, True).ready


def test_expected_worker_that_never_appears_becomes_dead():
    t = FakeTime()
    table = ClockTable(num_workers=2, dead_after_s=3, time_fn=t)
    table.seen("0", 1)
    assert not table.gate(1, 0, True, False).ready
    t.now += 4
    table.seen("0", 1)
    assert table.gate(1, 0, True, False).dead_worker == "1"
    assert table.snapshot() == {"0": {"clock": 1, "live": True}, "1": {"clock": 0, "live": False}}


def test_time_before_the_first_worker_arrives_does_not_count_against_the_others():
    t = FakeTime()
    table = ClockTable(num_workers=2, dead_after_s=3, time_fn=t)
    t.now += 100  # servers started long before the workers
    table.seen("0", 1)
    assert table.is_live("1") and not table.gate(1, 0, True, False).ready  # worker 1 is awaited
    t.now += 3.5
    assert table.gate(1, 0, True, False).dead_worker == "1"


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_workers"):
        ClockTable(num_workers=-1)
    with pytest.raises(ValueError, match="dead_after_s"):
        ClockTable(dead_after_s=0)
