"""Per-op cost figures of this machine, measured by short micro-benchmarks (``trainmesh plan --calibrate``).

What ``op_costs.price`` needs, each from its own probe, none from a model the planner is asked about:

* ``floor``: the time of the cheapest op (a 1-element add, no autograd): dispatch alone. The curves
  below subtract it, so a small op's rate is its work's rate, and the overhead is priced once;
* ``flops_curve``: FLOP/s of square fp32 matmuls of 16..1024 in the three layouts a linear layer's
  step uses (small matmuls get far less than large);
* ``bandwidth_curve``: bytes/s of adds of 1 KiB..64 MiB per operand into fresh outputs (as a step's
  ops allocate theirs), each on operands the previous ones did not touch (small ones stay
  cache-resident and move faster);
* ``op_kind_curves`` (``calibrate_op_kinds``): attention's FLOP rate and each arithmetic-bound
  element-wise op's bytes/s, the kinds of op neither curve above describes;
* ``op_overhead``: a training step (forward, backward, Adam) of a tiny MLP-and-norm model whose
  work is negligible, over the ops it dispatched (counted by ``op_costs.OpProfile``): what each op
  costs in module calls, autograd and the optimizer's Python loop;
* ``dtensor_op_overhead``: the same model tensor-parallel over 2 ranks of torch's fake process
  group (trainmesh's own ``parallelize``; collectives return at once), the extra time per op
  that ran on DTensors: sharding propagation;
* ``external_load``: others' processes competing for the cores while it measured (from the share of
  a core the probe got, and the host's busy time in ``/proc/stat``): their share is in the figures
  above, and in what the job's processes will get (``Hardware.contention``).

All on the thread count the process has now (``torch.get_num_threads()``), which is what each
training process will have. Each probe takes the median of repeats: the machine may be loaded.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch
from torch import nn

from .calibrate_op_kinds import measure_op_kind_curves
from .op_costs import OpProfile, price

MATMUL_SIZES = (16, 32, 64, 128, 256, 512, 1024)
ADD_NUMELS = tuple(2**k for k in range(8, 25, 2))  # 1 KiB .. 64 MiB per fp32 operand


def _median_time(fn, repeats: int, inner: int = 1) -> float:
    fn()  # warm-up: allocator, thread pool, kernel choice
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def measure_floor(repeats: int = 21) -> float:
    a, b = torch.ones(1), torch.ones(1)
    return _median_time(lambda: torch.add(a, b), repeats, inner=200)


def measure_flops_curve(floor: float, repeats: int = 7) -> tuple:
    """A linear layer's step runs its matmul three ways (forward ``x @ W.T``, input gradient ``g @ W``,
    weight gradient ``g.T @ x``); each size is timed in all three layouts and the mean taken."""
    points = []
    for n in MATMUL_SIZES:
        a, b = torch.randn(n, n), torch.randn(n, n)
        inner = max(1, 2**20 // n**2)
        t = statistics.mean(
            _median_time(fn, repeats, inner) for fn in (lambda: a @ b.t(), lambda: a @ b, lambda: a.t() @ b)
        )
        points.append((2 * n**3, 2 * n**3 / max(t - floor, t * 0.05)))
    return tuple(points)


def measure_bandwidth_curve(floor: float, repeats: int = 7, pool_bytes: int = 256 * 2**20) -> tuple:
    """Each add reads and writes tensors the previous adds did not touch (a pool of ``pool_bytes``,
    8x a large L3): a step's working set (weights, activations, optimizer state) is far larger than
    the caches, so its ops mostly find their operands in memory, not in cache. Ops too small to
    leave the cache stay in it (the pool is capped at 2,048 operands)."""
    points = []
    for numel in ADD_NUMELS:
        moved = 3 * numel * 4
        count = max(2, min(2048, pool_bytes // moved))
        pool = [(torch.ones(numel), torch.ones(numel)) for _ in range(count)]

        def sweep():
            for a, b in pool:  # noqa: F821 - the pool of this iteration: sweep runs before `del pool`
                torch.add(a, b)  # a fresh output, freed at once: what a step's temporaries cost the allocator

        t = _median_time(sweep, repeats) / count
        points.append((moved, moved / max(t - floor, t * 0.05)))
        del pool
    return tuple(points)


def measure_compute(hardware, repeats: int = 7):
    """A ``Hardware`` with this process's per-op figures measured now (curves, op kinds, per-op overhead); the
    DTensor overhead, links and cores are kept from ``hardware``."""
    from dataclasses import replace

    host = _host_busy()
    wall, cpu = time.perf_counter(), time.process_time()
    floor = measure_floor()
    flops_curve = measure_flops_curve(floor, repeats)
    bandwidth_curve = measure_bandwidth_curve(floor, repeats)
    out = replace(
        hardware,
        flops=max(r for _, r in flops_curve),
        flops_curve=flops_curve,
        bandwidth_curve=bandwidth_curve,
        memory_bandwidth=bandwidth_curve[-1][1],
        op_overhead=0.0,
        op_kind_curves=measure_op_kind_curves(floor, repeats),
    )  # before the overhead: its model has gelu
    overhead, _ = measure_op_overhead(out, repeats=2 * repeats + 1)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return replace(out, op_overhead=overhead, external_load=_external_load(hardware.cores, wall, cpu, host))


def _host_busy() -> float | None:
    """Seconds of CPU time the whole host has spent busy (Linux ``/proc/stat``), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _external_load(cores: int | None, wall: float, cpu: float, host_before: float | None) -> float:
    """Others' runnable processes while this one probed, from what it got and what the host did: if
    it got less than a core (``share = cpu / wall``), ``cores / share - 1`` processes shared with it
    (fair scheduling); if it got a whole core, the cores others kept busy beside it."""
    if not cores or wall <= 0:
        return 0.0
    share = min(1.0, cpu / wall)
    if share < 0.95:
        return cores / max(share, 1e-3) - 1
    after = _host_busy()
    if host_before is None or after is None:
        return 0.0
    return min(max(0.0, (after - host_before - cpu) / wall), cores - 1.0)


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def _tiny_model(width: int = 16, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block(width) for _ in range(depth)])


def _step_time(model: nn.Module, repeats: int) -> tuple[float, OpProfile]:
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(2, 4, 16)

    def step(profile: OpProfile | None = None):
        if profile is not None:
            profile.phase = "forward"
        loss = model(x).float().pow(2).mean()
        if profile is not None:
            profile.phase = "backward"
        loss.backward()
        if profile is not None:
            profile.phase = "optimizer"
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()  # warm-up; the optimizer state exists from here on
    with OpProfile() as profile:
        step(profile)
    return _median_time(step, repeats), profile


def measure_op_overhead(hardware, repeats: int = 15) -> tuple[float, int]:
    """(seconds per op, ops per step) of the tiny model's training step, its priced work taken out."""
    seconds, profile = _step_time(_tiny_model(), repeats)
    work = sum(price(profile, hardware).values())
    return max(seconds - work, 0.0) / profile.ops(), profile.ops()


def measure_dtensor_overhead(hardware, repeats: int = 9) -> float | None:
    """Extra seconds per DTensor op, from the tiny model tensor-parallel over 2 fake ranks; None when a
    process group already exists (the fake one cannot be started beside it)."""
    import torch.distributed as dist

    from trainmesh._torch.parallelize import parallelize

    from .mesh_spec import MeshSpec

    if dist.is_initialized():
        return None
    with _fake_group(2):
        model = _tiny_model()
        distribution = MeshSpec.parse("data=1,model=2", 2).distribution(model, zero_stage=0)
        model = parallelize(model, distribution, zero_stage=0, activation_checkpointing=None)
        seconds, profile = _step_time(model, repeats)
    work = sum(price(profile, hardware).values())  # hardware carries op_overhead by now
    dtensor_ops = sum(n for (_, d, *_), n in profile.counts.items() if d)
    return max(seconds - work, 0.0) / max(dtensor_ops, 1)


def measure_fsdp_overhead(hardware, repeats: int = 9) -> float | None:
    """Extra seconds per FSDP2 collective call (one unit's all-gather or reduce-scatter) besides the ops
    it dispatches: FSDP2's hooks and bookkeeping around each unit's unshard, reshard and reduce, from the
    tiny model under ZeRO-3 over 2 ranks of torch's fake process group (collectives return at once: their
    own cost is the link's, ``Hardware.collective_costs``). None when a process group already exists."""
    import torch.distributed as dist

    from trainmesh._torch.mesh import to_torch_mesh
    from trainmesh._torch.parallelize import parallelize

    from .collectives import CollectiveCounter, group_axes
    from .mesh_spec import MeshSpec

    if dist.is_initialized():
        return None
    with _fake_group(2):
        model = _tiny_model()
        distribution = MeshSpec.parse("data=2", 2).distribution(model, zero_stage=3)
        counter = CollectiveCounter(group_axes(to_torch_mesh(distribution.device_mesh)))
        model = parallelize(model, distribution, zero_stage=3, activation_checkpointing=None)
        seconds, profile = _step_time(model, repeats)
        with counter:  # the calls of one step (forward and backward: the optimizer step issues none)
            model(torch.randn(2, 4, 16)).float().pow(2).mean().backward()
    calls = sum(row["count"] for row in counter.log.rows() if row["kind"] in ("all_gather", "reduce_scatter"))
    work = sum(price(profile, hardware).values())  # every op, with the per-op and DTensor overheads
    return max(seconds - work, 0.0) / max(calls, 1)


@contextlib.contextmanager
def _fake_group(world_size: int):
    """Torch's fake process group for the duration (collectives return at once), then everything it
    left behind undone: trainmesh's runtime, the group, and DTensor's sharding cache (whose entries
    name meshes that are gone)."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainmesh import runtime

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        runtime.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
        _clear_sharding_prop_cache()


__all__ = [
    "measure_floor",
    "measure_flops_curve",
    "measure_bandwidth_curve",
    "measure_op_overhead",
    "measure_dtensor_overhead",
    "measure_fsdp_overhead",
    "measure_compute",
]
