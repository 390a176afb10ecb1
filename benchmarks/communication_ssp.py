"""communication.py's parameter-server part: SSP against synchronous training with a straggler, on two
shaped hosts (``ssp_straggler.py``, the figure) and, in the full run, with held-back workers on loopback.

It exists apart from the script because it measures another system (the parameter server) than the
all-reduce variants the rest of the script compares.
"""

from __future__ import annotations

import random
import statistics
import time

import torch
from torch import nn


# --- SSP vs sync with a straggler (parameter server) ----------------------------------------------
COMPUTE_S, PS_DIM, PS_LR, TARGET_FRACTION, PS_STEPS = 0.010, 64, 0.01, 0.005, 400
SSP_MODES = ("sync", "ssp:4")


def _held_back(schedule: str, rank: int, rng: random.Random) -> float:
    """Seconds of simulated compute this step. ``persistent``: worker 1 (the straggler host) always
    takes twice as long. ``transient``: each worker, independently, is held back 6x on a quarter of
    its steps (a noisy host: GC, a neighbour's burst). No netem on this kernel, so no link delay."""
    if schedule == "persistent":
        return COMPUTE_S * (2 if rank == 1 else 1)
    return COMPUTE_S * (6 if rng.random() < 0.25 else 1)


def _ps_run(mode: str, schedule: str) -> dict:
    import torch.distributed as dist

    import trainmesh as tm

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    truth = torch.randn(PS_DIM, 1, generator=gen)
    x_eval = torch.randn(1024, PS_DIM, generator=gen)
    y_eval = x_eval @ truth
    gen, rng = torch.Generator().manual_seed(100 + rank), random.Random(7 + rank)
    torch.manual_seed(0)
    model = nn.Linear(PS_DIM, 1)
    with torch.no_grad():
        target = TARGET_FRACTION * float(nn.functional.mse_loss(model(x_eval), y_eval))
    # dead_after_s: a worker that has left stops holding the other's SSP pulls after 2 s (teardown only).
    strategy = tm.ParameterServerStrategy(num_servers=1, mode=mode, dead_after_s=2.0)
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=PS_LR))
    # Every worker takes the same fixed number of steps (no early stop): a worker that left early
    # would strand the other's gated pull. Rank 0 notes when the model first reaches the target.
    dist.barrier()
    started, reached = time.perf_counter(), None
    for steps in range(1, PS_STEPS + 1):
        xb = torch.randn(32, PS_DIM, generator=gen)
        loss = nn.functional.mse_loss(model(xb), xb @ truth)
        optimizer.zero_grad()
        loss.backward()
        time.sleep(_held_back(schedule, rank, rng))
        optimizer.step()
        if rank == 0 and reached is None:
            with torch.no_grad():
                if float(nn.functional.mse_loss(model(x_eval), y_eval)) <= target:
                    reached = time.perf_counter() - started
    dist.barrier()
    strategy.close()
    return {"seconds": reached, "steps": steps}


def _ps_worker(rounds: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for schedule in ("persistent", "transient"):
        for r in range(rounds):
            for mode in SSP_MODES if r % 2 == 0 else SSP_MODES[::-1]:
                out.setdefault(f"{schedule}/{mode}", []).append(_ps_run(mode, schedule))
    return out


def loopback_ssp_part(rounds: int) -> dict:
    from trainmesh.testing import run_distributed

    runs = run_distributed(_ps_worker, 2, args=(rounds,), timeout=900, collective_timeout=300)[0]
    out = {"runs": runs}
    print(
        f"\nparameter server on loopback, 2 workers, a held-back worker (sleep), time to {TARGET_FRACTION} x "
        f"initial loss (median of {rounds}):"
    )
    for schedule in ("persistent", "transient"):
        sec = {m: statistics.median([r["seconds"] or float("inf") for r in runs[f"{schedule}/{m}"]]) for m in SSP_MODES}
        out[schedule] = sec[SSP_MODES[1]] / sec["sync"]
        print(
            f"  {schedule:<10} sync {sec['sync']:.2f}s  {SSP_MODES[1]} {sec[SSP_MODES[1]]:.2f}s  "
            f"ratio {out[schedule]:.2f}"
        )
    return out


def ssp_part(quick: bool, rate: str) -> dict:
    """The figure: a straggler host (ssp_straggler.py); extras: held-back workers on loopback
    (left out with --quick, which keeps to about a minute)."""
    from ssp_straggler import ssp_host_part  # this folder's (benchmarks run as scripts)

    out = ssp_host_part(1 if quick else 3, 45 if quick else 60, rate)
    if not quick:
        loopback = out["loopback"] = loopback_ssp_part(3)
        out.update(persistent=loopback["persistent"], transient=loopback["transient"])
    return out
