"""communication="auto" times its candidate reductions interleaved (comm/probe.py): each repetition
runs every candidate once, in a rotated order, so load that comes and goes lands on all of them; a
burst during one candidate's repetitions can no longer decide the choice alone."""

import pytest
import torch.distributed as dist

from trainmesh.comm import probe

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def one_process_group():
    """A one-process gloo group for the probe's barriers and all-reduce, destroyed after the test
    (the planner's tests after this one start a fake group and need none)."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


def test_candidates_run_interleaved_in_rotated_order_and_report_medians(one_process_group, monkeypatch):
    calls = []
    clock = [0.0]
    durations = {"a": [1.0, 1.0, 9.0, 1.0, 1.0, 1.0], "b": [2.0, 2.0, 2.0, 2.0, 9.0, 2.0]}

    def run(name):
        def fn():
            calls.append(name)
            clock[0] += durations[name].pop(0)

        return fn

    monkeypatch.setattr(probe.time, "perf_counter", lambda: clock[0])
    medians = probe._time_interleaved({"a": run("a"), "b": run("b")}, reps=5)
    # one warm-up each, then every repetition runs both, the first one alternating
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    # a slow run (9 s) in either candidate's repetitions does not move its median
    assert medians == {"a": 1.0, "b": 2.0}


def test_a_load_burst_lands_on_every_candidate_alike(one_process_group, monkeypatch):
    """A burst lasting three consecutive runs: timed in blocks (each candidate's five in a row, as
    before) it slows the fast candidate alone, past the slow one; interleaved it slows at most two
    runs of each, and the medians keep their true order."""
    clock = [0.0]
    base = {"fast": 1.0, "slow": 1.5}

    def candidates():
        calls = []

        def run(name):
            def fn():
                calls.append(name)
                burst = 3 <= len(calls) <= 5  # the third to fifth run, whichever candidates they are
                clock[0] += base[name] * (4.0 if burst else 1.0)

            return fn

        return {"fast": run("fast"), "slow": run("slow")}

    monkeypatch.setattr(probe.time, "perf_counter", lambda: clock[0])
    blocks = candidates()
    in_blocks = {name: probe._time(fn, 5) for name, fn in blocks.items()}
    assert in_blocks["fast"] > in_blocks["slow"], in_blocks  # the burst decided it
    medians = probe._time_interleaved(candidates(), reps=5)
    assert medians == {"fast": 1.0, "slow": 1.5}
