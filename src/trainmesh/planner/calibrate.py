"""``trainmesh plan --calibrate``: this machine's per-op costs and its link's alpha and beta, measured.

* Per-op costs (``calibrate_ops``): matmul FLOP/s and memory bandwidth as curves over op size,
  attention's FLOP/s and each arithmetic-bound element-wise op's bytes/s (``calibrate_op_kinds``),
  the dispatch overhead of an op in a training step and the extra of an op on DTensors, on the
  threads the process has; ``op_costs.price`` prices every op of a dry-run step with them.
* Links: all-reduces of 4 KiB .. 8 MiB between two gloo processes on loopback
  (``trainmesh.testing.run_distributed``), median per size, and a least-squares fit of
  ``t = alpha + wire_bytes / beta`` (for two ranks a ring all-reduce sends the buffer once); the
  same for all-gathers and reduce-scatters of the same full buffers, each kind fitted on its own
  (``Hardware.collective_costs``): gloo's all-gather and reduce-scatter copy and set up more per
  byte and per call than its all-reduce, and FSDP2's steps are made of them; and point-to-point
  messages (a ping-pong, half a round trip each), which a pipeline's stages exchange.
* Cores: the CPUs this process may run on, and how much slower each of 1, 2, 4 and 8 processes run
  at once than one alone (``calibrate_cores``: the host's other load, the scheduler, shared caches and
  memory bus; ``Hardware.contention``).

* Between hosts, with ``--host-link RATE`` (``calibrate_hosts``): the same collectives between two
  network-namespace hosts of this machine whose links are shaped to RATE; the plan's inter-node link.

The result is a ``Hardware`` (backend gloo; intra- and inter-node links both loopback unless a host link
was measured), cached per machine, torch version and thread count (``--hardware calibrated`` reads the
cache), and written with ``--json PATH`` for ``--hardware PATH``. Real machines' links between hosts
are not measured here: a plan over them takes their figures from a JSON file or published figures.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

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


# The collectives a step issues, each timed on its own: gloo runs them with different code (an
# all-gather copies the local shard into the output; a reduce-scatter all-reduces a copy of the whole
# input and copies its piece out; each call sets up its own work in the caller's thread), so one
# kind's alpha and beta do not price the others.
# A pipeline's stages hand activations and gradients on point to point (``send_recv``): timed as a
# ping-pong, half a round trip per message, so each message pays what a stage pays in a step: the
# receiver blocked in ``recv``, woken when the bytes land.
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def _issue(kind: str, buffer: torch.Tensor, shard: torch.Tensor) -> None:
    import torch.distributed as dist

    from trainmesh._torch.flat_collectives import all_gather_flat, reduce_scatter_flat

    if kind == "all_reduce":
        dist.all_reduce(buffer)
    elif kind == "send_recv":  # a round trip between the first two ranks (the others idle)
        rank = dist.get_rank()
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        elif rank == 1:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
    elif kind == "all_gather":  # the calls FSDP2 makes
        all_gather_flat(buffer, shard)
    else:
        reduce_scatter_flat(shard, buffer)


def _collective_times(sizes: list[int], repeats: int, kinds: tuple = ("all_reduce",)) -> dict[str, dict[int, float]]:
    """Median seconds of one call of each kind per full-buffer size (bytes), between the group's processes."""
    import torch.distributed as dist

    out: dict[str, dict[int, float]] = {}
    n = dist.get_world_size()
    for kind in kinds:
        out[kind] = {}
        for size in sizes:
            buffer = torch.zeros(size // 4)
            shard = torch.zeros(size // 4 // n)
            _issue(kind, buffer, shard)  # warm-up: connections, buffers
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                _issue(kind, buffer, shard)
                times.append(time.perf_counter() - start)
            out[kind][size] = statistics.median(times) / (2 if kind == "send_recv" else 1)  # per message
    return out


def fit_alpha_beta(times: dict[int, float], wire_factor: float = 1.0) -> tuple[float, float]:
    """Least squares of ``t = alpha + wire_factor * bytes / beta`` in *relative* error (weights 1/t), so
    the small messages that decide alpha count as much as the large ones that decide beta; alpha >= 0."""
    x = np.array([wire_factor * s for s in times], dtype=float)
    y = np.array(list(times.values()), dtype=float)
    slope, intercept = np.polyfit(x, y, 1, w=1.0 / y)
    return max(float(intercept), 0.0), 1.0 / max(float(slope), 1e-15)


def calibrate_link(repeats: int = 7, sizes: list[int] | None = None) -> Link:
    """Alpha/beta of loopback between two gloo processes on this machine (all-reduces)."""
    return calibrate_collectives(repeats, sizes, kinds=("all_reduce",))[0]


def calibrate_collectives(repeats: int = 7, sizes: list[int] | None = None, kinds: tuple = KINDS) -> tuple[Link, tuple]:
    """The loopback link (all-reduce's alpha/beta) and ``((kind, alpha, beta), ...)`` of every kind in
    ``kinds``, each fitted to its own times against the wire bytes gloo's algorithm sends for it."""
    from trainmesh.testing import run_distributed

    from .collectives import wire_bytes

    times = run_distributed(_collective_times, world_size=2, args=(sizes or SIZES, repeats, kinds), timeout=300)[0]
    costs = tuple((kind, *fit_alpha_beta(times[kind], wire_bytes(kind, 1.0, 2, "gloo"))) for kind in kinds)
    alpha, beta = next((a, b) for k, a, b in costs if k == "all_reduce")
    return Link("loopback", alpha, beta), costs


def cache_path() -> Path:
    """Where ``calibrate`` keeps its figures (beside ``trainmesh env --peak``'s cache)."""
    root = os.environ.get("TRAINMESH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "trainmesh"
    )
    return Path(root) / "plan_calibration.json"


def _key() -> str:
    # the figures hold for this machine, this torch and this many threads per process
    return f"{platform.node()}|{platform.machine()}|torch {torch.__version__}|threads={torch.get_num_threads()}"


def calibrate(
    n: int = 1024,
    *,
    link: bool = True,
    save: bool = True,
    contention: bool = True,
    host_link: str | None = None,
    processes_per_host: int = 1,
) -> "CalibratedHardware":
    """Measure this machine (about a minute): per-op cost curves and overheads (``calibrate_ops``) on the
    threads this process has, the loopback link's alpha/beta between two gloo processes, and how much
    slower each of 1-8 processes runs at once (``calibrate_cores``; ``contention=False`` skips it).
    With ``host_link`` (a rate, "1gbit"), also the link between two namespace hosts shaped to it
    (``calibrate_hosts``): the inter-node link of hosts of ``processes_per_host`` processes each."""
    from .calibrate_ops import measure_compute, measure_dtensor_overhead, measure_fsdp_overhead

    loop, costs = calibrate_collectives() if link else (Link("loopback", 0.0, float("inf")), ())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    hardware = CalibratedHardware(
        name="calibrated",
        source=f"calibrated on {platform.node() or 'this machine'} ({cores} cores, "
        f"{torch.get_num_threads()} thread(s) per process, torch {torch.__version__}): matmul and add curves, "
        "attention and arithmetic-bound element-wise ops, "
        "op overheads of a tiny model's step, gloo all-reduce on loopback, 1-8 processes sharing the cores",
        flops=0.0,
        devices_per_node=1 << 30,
        intra=loop,
        inter=loop,
        cores=cores,
        backend="gloo",
        collective_costs=costs,
    )
    hardware = measure_compute(hardware)
    hardware = replace(hardware, dtensor_op_overhead=measure_dtensor_overhead(hardware) or 0.0)
    hardware = replace(hardware, fsdp_call_overhead=measure_fsdp_overhead(hardware) or 0.0)
    if contention:
        from .calibrate_cores import measure_contention

        hardware = replace(hardware, contention_curve=measure_contention())
    if host_link:
        from .calibrate_hosts import measure_host_link, with_host_link

        hardware = with_host_link(hardware, *measure_host_link(host_link), processes_per_host)
    if save:
        _save(hardware)
    return hardware


def _save(hardware: Hardware) -> None:
    path = cache_path()
    try:
        cached = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        cached = {}
    cached[_key()] = hardware.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cached, indent=1))
    os.replace(tmp, path)


def cached_calibration() -> "CalibratedHardware | None":
    """The figures ``calibrate`` saved for this machine, torch and thread count, or None."""
    try:
        data = json.loads(cache_path().read_text()).get(_key())
    except (OSError, ValueError):
        return None
    return CalibratedHardware.from_dict(data) if data else None


class CalibratedHardware(Hardware):
    def describe(self) -> str:
        curve = lambda points, unit: ", ".join(f"{s:.0e}: {r / 1e9:.1f}" for s, r in points) + f" {unit}"  # noqa: E731
        return (
            f"{self.source}\n  FLOP rate   {self.flops / 1e9:.1f} GFLOP/s (best matmul)\n"
            f"  matmuls     {curve(self.flops_curve, 'GFLOP/s')} (by FLOPs)\n"
            f"  bandwidth   {curve(self.bandwidth_curve, 'GB/s')} (by bytes moved)\n"
            + (
                "  op kinds    "
                + "; ".join(f"{kind} {points[-1][1] / 1e9:.1f}" for kind, points in self.op_kind_curves)
                + " (G per s at the largest probe: FLOP/s for attention, bytes/s for the rest)\n"
                if self.op_kind_curves
                else ""
            )
            + f"  per op      {self.op_overhead * 1e6:.1f} us; on DTensors +{self.dtensor_op_overhead * 1e6:.1f} us; "
            f"per FSDP2 gather or reduce-scatter call +{self.fsdp_call_overhead * 1e6:.1f} us\n"
            f"  cores       {self.cores} (others' runnable processes while measured: {self.external_load:.1f})\n"
            + (
                "  processes   "
                + ", ".join(f"{p}: {s:.2f}x" for p, s in self.contention_curve)
                + " slower each than one alone (run at once)\n"
                if self.contention_curve
                else ""
            )
            + f"  {self.intra.name:<11} alpha {self.intra.alpha * 1e6:.1f} us, beta {self.intra.beta / 1e9:.2f} GB/s"
            + "".join(
                f"\n  {kind:<15} alpha {alpha * 1e6:.1f} us, beta {beta / 1e9:.2f} GB/s (of wire bytes)"
                for kind, alpha, beta in self.collective_costs
            )
            + (
                f"\n  {self.inter.name:<11} alpha {self.inter.alpha * 1e6:.1f} us, beta {self.inter.beta / 1e9:.3f} GB/s "
                f"(between namespace hosts of {self.devices_per_node} process(es))"
                + "".join(
                    f"\n    {kind:<13} alpha {alpha * 1e6:.1f} us, beta {beta / 1e9:.3f} GB/s (of wire bytes)"
                    for kind, alpha, beta in self.inter_collective_costs
                )
                if self.inter != self.intra
                else ""
            )
        )
