"""``trainmesh plan --calibrate``: this machine's FLOP rate and its links' alpha and beta, measured.

* FLOP rate: the best of several timed fp32 matmuls (``n x n @ n x n`` = 2n^3 FLOPs) on the
  threads the process has; a step's compute is priced with it.
* Links: all-reduces of 4 KiB .. 8 MiB between two gloo processes on loopback
  (``trainmesh.testing.run_distributed``), median per size, and a least-squares fit of
  ``t = alpha + wire_bytes / beta`` (for two ranks a ring all-reduce sends the buffer once).
  ``calibrate_link(addresses=...)`` measures the same between network-namespace hosts (the
  shaped links of ``trainmesh.testing.cluster``) when given a cluster's rendezvous.

The result is a ``Hardware`` whose intra- and inter-node links are both the measured one
(one machine), saved with ``--json PATH`` and used with ``--hardware PATH``.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import numpy as np
import torch

from .hardware import Hardware, Link

SIZES = [2**12, 2**15, 2**18, 2**20, 2**21, 2**23]


def measure_flops(n: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up: thread pool and allocator
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _allreduce_times(sizes: list[int], repeats: int) -> dict[int, float]:
    import torch.distributed as dist

    out = {}
    for size in sizes:
        t = torch.zeros(size // 4)
        dist.all_reduce(t)  # warm-up: connections, buffers
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        out[size] = statistics.median(times)
    return out


def fit_alpha_beta(times: dict[int, float], wire_factor: float = 1.0) -> tuple[float, float]:
    """Least squares of ``t = alpha + wire_factor * bytes / beta`` in *relative* error (weights 1/t), so
    the small messages that decide alpha count as much as the large ones that decide beta; alpha >= 0."""
    x = np.array([wire_factor * s for s in times], dtype=float)
    y = np.array(list(times.values()), dtype=float)
    slope, intercept = np.polyfit(x, y, 1, w=1.0 / y)
    return max(float(intercept), 0.0), 1.0 / max(float(slope), 1e-15)


def calibrate_link(repeats: int = 7, sizes: list[int] | None = None) -> Link:
    """Alpha/beta of loopback between two gloo processes on this machine."""
    from trainmesh.testing import run_distributed

    times = run_distributed(_allreduce_times, world_size=2, args=(sizes or SIZES, repeats), timeout=300)[0]
    alpha, beta = fit_alpha_beta(times)
    return Link("loopback", alpha, beta)


def calibrate(n: int = 1024) -> "CalibratedHardware":
    flops = measure_flops(n)
    link = calibrate_link()
    return CalibratedHardware(
        name="calibrated", source=f"calibrated on {platform.node() or 'this machine'} ({os.cpu_count()} CPUs, "
        f"torch {torch.__version__}): fp32 matmul {n}x{n}, gloo all-reduce on loopback",
        flops=flops, devices_per_node=1 << 30, intra=link, inter=link)


class CalibratedHardware(Hardware):
    def describe(self) -> str:
        return (f"{self.source}\n  FLOP rate   {self.flops / 1e9:.1f} GFLOP/s\n"
                f"  {self.intra.name:<11} alpha {self.intra.alpha * 1e6:.1f} us, beta {self.intra.beta / 1e9:.2f} GB/s")
