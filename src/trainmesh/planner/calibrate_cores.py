"""How a CPU host's cores serve P processes of one job at once (``trainmesh plan --calibrate``).

The per-op figures (``calibrate_ops``) are measured by one process alone. A job's P processes on a
host run at once, and each then gets less than that one process got:

* more processes than cores: each gets a share of a core, and pays the scheduler's context
  switches and the caches the others evict;
* fewer: they still share the memory bus, the last-level cache, and the cores with the host's
  other work, and how much of it the job gets is the scheduler's business (Linux's autogroup
  gives every session an equal share whatever its processes' nice values; a job of P processes
  in one session gets no more of the host for having more of them).

None of this can be read from the core count. ``measure_contention`` measures it: P processes
(spawned together, one session, the thread count of the caller) run the same unit of work, a
mix of what a training step does (matmuls of a linear layer's three layouts, memory-bound adds
over a pool larger than the caches, a tiny model's training step, which is dispatch-bound), for
the same wall-clock window, all at once; ``slowdown(P)`` is the rate one process got alone over
the rate of the slowest of the P: a step ends at a collective every process must reach, so it
goes at the pace of the slowest process, not of a typical one (the cores of a shared host do not
serve P processes alike). The plan multiplies each process's CPU work by it
(``Hardware.contention``). It is measured with the host's load *now*: a plan of a shared host is
a plan of its load at calibration time (``benchmarks/plan_accuracy.py`` repeats the probe every
round, beside the steps it prices).

>>> work = probe_work()
>>> units, wall, cpu = run_window(work, 0.05)
>>> units >= 1 and wall >= 0.05
True
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import torch

PROCESSES = (1, 2, 4, 8)
WINDOW_S = 1.0


def probe_work():
    """One unit of a training step's kinds of work, about 10 ms on one core of a laptop-class CPU."""
    from .calibrate_ops import _tiny_model  # the dispatch-bound part

    torch.manual_seed(0)
    a, b = torch.randn(192, 192), torch.randn(192, 192)
    pool = [torch.randn(2**16) for _ in range(96)]  # 24 MiB: past a shared last-level cache
    model = _tiny_model()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(2, 4, 16)

    def unit():
        for _ in range(4):
            a @ b.t(), a @ b, a.t() @ b
        for i in range(0, len(pool), 2):
            torch.add(pool[i], pool[i + 1])
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    unit()  # warm-up: allocator, optimizer state
    return unit


def run_window(work, seconds: float) -> tuple[int, float, float]:
    """Run ``work`` until ``seconds`` of wall clock have passed: (units done, wall, CPU seconds)."""
    units, start, cpu = 0, time.perf_counter(), time.process_time()
    while True:
        work()
        units += 1
        wall = time.perf_counter() - start
        if wall >= seconds:
            return units, wall, time.process_time() - cpu


def _child(index: int, threads: int, plan: list[int], window: float, barrier, queue) -> None:
    torch.set_num_threads(threads)
    work = probe_work()
    for processes in plan:
        barrier.wait()  # every child here: the window starts together (waiting children use no CPU)
        if index < processes:
            units, wall, cpu = run_window(work, window)
            queue.put((processes, index, units / wall, cpu / wall))
        barrier.wait()


def measure_contention(processes: tuple[int, ...] = PROCESSES, window: float = WINDOW_S) -> tuple:
    """``((P, slowdown), ...)``: how much slower each of P concurrent processes runs than one alone.

    One process alone is measured first and last (the host's load moves); its mean rate is the
    reference. Processes are spawned (a fork of a process with a thread pool can hang)."""
    if any(not isinstance(p, int) or p < 1 for p in processes):
        raise ValueError(f"processes must be ints >= 1. Received: processes={processes!r}")
    ctx = mp.get_context("spawn")
    most = max(processes)
    plan = [1, *sorted(set(processes) - {1}), 1]
    barrier, queue = ctx.Barrier(most), ctx.Queue()
    children = [
        ctx.Process(target=_child, args=(i, torch.get_num_threads(), plan, window, barrier, queue), daemon=True)
        for i in range(most)
    ]
    for child in children:
        child.start()
    results: dict[int, list[float]] = {}
    try:
        expected = sum(plan)
        for _ in range(expected):
            # a hang guard: spawning 8 processes that import torch took over 2 minutes at load average 20
            p, _, rate, _ = queue.get(timeout=300 + 4 * window * len(plan))
            results.setdefault(p, []).append(rate)
    finally:
        for child in children:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
    alone = statistics.mean(results[1])
    return tuple((p, 1.0 if p == 1 else alone / pace_of(results[p])) for p in sorted(set(processes) | {1}))


def pace_of(rates) -> float:
    """The rate a synchronous step of processes running at ``rates`` goes at: the slowest's."""
    return min(rates)


def slowdown_at(curve: tuple, processes: int) -> float:
    """The slowdown of ``processes`` concurrent processes from a measured curve: linear between
    points; past the last, each process's share shrinks in proportion (``last * P / P_last``)."""
    if not curve:
        return 1.0
    points = sorted(curve)
    if processes <= points[0][0]:
        return max(points[0][1], 1.0) if processes >= 1 else 1.0
    for (p0, s0), (p1, s1) in zip(points, points[1:]):
        if processes <= p1:
            return s0 + (s1 - s0) * (processes - p0) / (p1 - p0)
    p_last, s_last = points[-1]
    return s_last * processes / p_last


__all__ = ["measure_contention", "pace_of", "slowdown_at", "probe_work", "run_window", "PROCESSES"]
