"""ps.py's part 3, stragglers: the time until a linear-regression model reaches a target loss under
``ParameterServerStrategy`` sync / async / ssp:2 and under torch DDP all-reduce, on 2 gloo processes with worker 1
a 2x straggler (``straggler_worker``, run on every rank through ``run_distributed``), and its summary per variant.

It exists apart from the script because it runs inside the worker processes, the script outside them.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as torch_dist
from torch import nn

import trainmesh as tm
from trainmesh.testing import run_distributed

STRAGGLER_VARIANTS = ("ps-sync", "ps-async", "ps-ssp:2", "ddp-allreduce")
COMPUTE_S, DIM, LR, TARGET_FRACTION, MAX_SECONDS = 0.010, 64, 0.01, 0.005, 60.0


# --- part 3: time to a target loss with a straggler ----------------------------------------------------
def _regression_data(rank: int):
    gen = torch.Generator().manual_seed(0)
    truth = torch.randn(DIM, 1, generator=gen)
    x_eval = torch.randn(1024, DIM, generator=gen)
    return truth, (x_eval, x_eval @ truth), torch.Generator().manual_seed(100 + rank)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(DIM, 1)


def _one_run(variant: str, flag_dir: str, tag: str) -> dict:
    rank = torch_dist.get_rank()
    truth, (x_eval, y_eval), gen = _regression_data(rank)
    model = _model()
    with torch.no_grad():
        target = TARGET_FRACTION * float(nn.functional.mse_loss(model(x_eval), y_eval))
    strategy = None
    if variant == "ddp-allreduce":
        model = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    else:
        strategy = tm.ParameterServerStrategy(num_servers=2, mode=variant.removeprefix("ps-"))
        model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    lockstep = variant in ("ps-sync", "ddp-allreduce")
    stop_file = os.path.join(flag_dir, f"stop-{tag}")
    torch_dist.barrier()
    started, steps, reached = time.perf_counter(), 0, None
    while True:
        x = torch.randn(32, DIM, generator=gen)
        loss = nn.functional.mse_loss(model(x), x @ truth)
        optimizer.zero_grad()
        loss.backward()
        time.sleep(COMPUTE_S * (2 if rank == 1 else 1))  # the straggler computes twice as long
        optimizer.step()
        steps += 1
        elapsed = time.perf_counter() - started
        stop = elapsed > MAX_SECONDS
        if rank == 0:
            with torch.no_grad():
                if float(nn.functional.mse_loss(model(x_eval), y_eval)) <= target:
                    reached, stop = elapsed, True
        if lockstep:  # everyone stops at the same step (the others wait on it anyway)
            flag = torch.tensor([1.0 if stop else 0.0])
            torch_dist.all_reduce(flag)
            stop = bool(flag.item())
        elif rank == 0 and stop:
            open(stop_file, "w").close()
        elif os.path.exists(stop_file):
            stop = True
        if stop:
            break
    if strategy is not None:
        strategy.close()
    torch_dist.barrier()
    return {"seconds": reached, "steps": steps}


def straggler_worker(rounds: int, flag_dir: str) -> dict:
    torch.set_num_threads(1)
    results: dict = {v: [] for v in STRAGGLER_VARIANTS}
    for r in range(rounds):
        order = STRAGGLER_VARIANTS if r % 2 == 0 else tuple(reversed(STRAGGLER_VARIANTS))
        for variant in order:
            results[variant].append(_one_run(variant, flag_dir, f"{r}-{variant}"))
    return results


def straggler_part(rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as flag_dir:
        results = run_distributed(straggler_worker, 2, args=(rounds, flag_dir), timeout=600)[0]
    summary = {}
    for variant, runs in results.items():
        times = [run["seconds"] for run in runs if run["seconds"] is not None]
        summary[variant] = {
            "seconds": statistics.median(times) if len(times) == len(runs) else None,
            "runs": runs,
            "steps_worker0": statistics.median(run["steps"] for run in runs),
        }
    base = summary["ddp-allreduce"]["seconds"]
    for m in summary.values():
        m["ratio_to_allreduce"] = m["seconds"] / base if m["seconds"] and base else None
    return summary
