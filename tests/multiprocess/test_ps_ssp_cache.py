"""SSP's client-side cache (ps/dense_cache.py) on 2 real workers and a real server process.

Every gradient is exactly 1 and SGD's lr is 1, so each push moves ``w`` by exactly -1/2 (the
gradient is divided by the 2 workers): the value a worker computes with says how many pushes it
includes. Under ``ssp:2`` a worker at clock c must compute with values that include every push
of clocks < c - 2 from both workers, i.e. at least 2 * (c - 2) pushes; the straggler (worker 1)
must mostly not wait for a pull; and no push may be lost although ``step()`` waits for none.
A refused push (a negative lr) still raises, at most staleness + 1 steps later.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import trainmesh as tm
from trainmesh.ps.errors import PSError
from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(150)]

STEPS, STALENESS, NUMEL = 30, 2, 8


class Vector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(NUMEL))


def ssp_cache_worker() -> dict:
    torch.set_num_threads(1)
    rank = tm.rank()
    strategy = tm.ParameterServerStrategy(num_servers=1, mode=f"ssp:{STALENESS}")
    model = Vector()
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    client, cache = strategy.client, strategy.dense_cache
    used = []  # (clock, pushes included in the values this step computes with)
    for _ in range(STEPS):
        w = model.w.detach()
        assert torch.equal(w, w[0].expand_as(w))
        used.append((client.clock_value, round(float(-w[0]) * 2)))
        optimizer.zero_grad()
        model.w.sum().backward()
        if rank == 1:
            time.sleep(0.05)  # the straggler: the other worker runs ahead, up to the bound
        optimizer.step()
    blocking, steps, max_lead = cache.blocking_pulls, cache.steps, cache.max_lead
    optimizer.flush()
    tm.barrier()  # both workers' pushes are acknowledged
    strategy.pull_dense()
    final = model.w.detach().clone()
    servers = strategy.stats()["servers"]
    tm.barrier()  # both read the final value before either pushes again (worker 1's next push is valid)
    # A refused push surfaces: worker 0 pushes with lr -1 (the servers refuse it) while both take
    # the same extra steps (so neither gate waits on a worker that stopped). At most staleness + 1
    # steps stay in flight, so the first refusal raises by extra step staleness + 2.
    raised_at = None
    for extra in range(1, STALENESS + 3):
        if rank == 0:
            optimizer.param_groups[0]["lr"] = -1.0
        optimizer.zero_grad()
        model.w.sum().backward()
        try:
            optimizer.step()
        except PSError as error:
            raised_at = raised_at or (extra, str(error))
    try:
        optimizer.flush()
    except PSError as error:  # later than the bound promises
        raised_at = raised_at or (STALENESS + 3, str(error))
        optimizer.flush(raise_errors=False)  # the later refused pushes too
    tm.barrier()
    strategy.close()
    return {
        "used": used,
        "blocking": blocking,
        "steps": steps,
        "max_lead": max_lead,
        "final": final.tolist(),
        "server_lead": max(s["max_staleness_observed"] for s in servers),
        "raised_at": raised_at,
    }


def test_ssp_cache_keeps_the_bound_loses_no_push_and_spares_the_stragglers_pulls():
    results = run_distributed(ssp_cache_worker, 2, timeout=120)
    for rank, result in enumerate(results):
        for clock, included in result["used"]:
            assert included >= 2 * (clock - STALENESS), (rank, clock, included, result["used"])
        assert result["max_lead"] <= STALENESS and result["server_lead"] <= STALENESS, result
        # every push applied exactly once: 2 workers x STEPS pushes of -1/2
        assert result["final"] == [-float(STEPS)] * NUMEL, result["final"]
    fast, straggler = results
    assert fast["max_lead"] == STALENESS, fast  # it did run ahead on a stale copy, to the bound
    assert straggler["steps"] == STEPS and straggler["blocking"] <= STEPS // 2, straggler  # sync: every step
    extra, text = fast["raised_at"]
    assert extra <= STALENESS + 2 and "lr must be" in text, fast["raised_at"]
    assert straggler["raised_at"] is None, straggler
