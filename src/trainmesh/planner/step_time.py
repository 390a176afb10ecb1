"""Step time of one planned mesh on a piece of hardware, priced from what the dry runs measured.

It exists apart from ``parallel.py`` because pricing is its own model (per-op compute, alpha-beta
collectives, overlap, the pipeline bubble, shared CPU cores) that ``plan_accuracy`` and the tests
call directly on hand-made ``RankResult``s, without planning a model.

Step time on ``hardware``: compute is every op the dry run dispatched, priced one by one
  (``op_costs.price``: matmuls by FLOPs at the rate a matmul of that size gets, memory-bound ops
  such as norms, activations and the optimizer's updates by the bytes they move, plus a per-op
  dispatch overhead and DTensor's sharding-propagation overhead), split into forward, backward
  and optimizer (plus ``fsdp hooks``: FSDP2's own work per gather or reduce-scatter call, where
  calibrated); each axis's collectives priced by the alpha-beta model with the backend's
  algorithms and each kind's own figures where measured (``hardware.axis_seconds``). Model- and pipe-axis traffic is on the critical path;
  batch-axis traffic (DDP buckets, FSDP2 gathers and reduce-scatters) overlaps forward and
  backward where the hardware can overlap (devices; a CPU host with a core to spare), and only
  its excess shows; a pipeline adds the (p-1)/m bubble. On a CPU host whose cores the processes
  share (with each other and with other load), the step is at least the work each process asks
  for times how much slower each of the node's processes runs when all run at once than one alone
  (``Hardware.contention``: measured by ``calibrate_cores`` where calibrated; the output names it;
  a pipeline's bubble and the work done beside another stage's bubble at the slowdown of the
  processes that run then). Traffic counts there at its CPU cost, its price on the link inside a
  node; what a slower link between nodes adds is waiting, added once, not stretched by the share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .rank_result import RankResult
from .experts import expert_axis_strides
from .hardware import Hardware, axis_seconds
from .mesh_spec import MeshSpec
from .op_costs import price


@dataclass
class StepEstimate:
    compute: float
    axes: dict[str, float]  # seconds per axis
    exposed: dict[str, float]  # seconds per axis that compute does not hide
    seconds: float
    mfu: float | None
    phases: dict[str, float] = field(default_factory=dict)  # forward / backward / optimizer seconds

    @property
    def comm_share(self) -> float:
        """Exposed communication over step time (the pipeline bubble is idle time, not communication)."""
        comm = sum(t for a, t in self.exposed.items() if not a.endswith(" bubble") and a != "cores shared")
        return comm / self.seconds if self.seconds else 0.0

    @property
    def scaling_efficiency(self) -> float:
        """Compute over step time: 1.0 when no communication shows."""
        return self.compute / self.seconds if self.seconds else 0.0


def _phases(r: RankResult, hardware: Hardware, accum: int, batch_axis: str | None = None) -> dict[str, float]:
    """Seconds of forward, backward and optimizer on one rank, alone on its device: every op priced
    (``op_costs.price``) when the hardware has per-op figures, else the FLOPs at the peak rate."""
    if r.ops is not None and (hardware.memory_bandwidth or hardware.op_overhead or hardware.flops_curve):
        phases = price(r.ops, hardware)
    else:  # forward : backward FLOPs are about 1 : 2
        phases = {
            "forward": r.flops / 3 / hardware.flops,
            "backward": 2 * r.flops / 3 / hardware.flops,
            "optimizer": 0.0,
        }
    if hardware.fsdp_call_overhead:
        # FSDP2's hooks around each unit's gather and reduce-scatter (batch axis), on the rank's own thread
        calls = sum(
            row["count"]
            for row in r.collectives.rows()
            if row["axis"] == batch_axis and row["kind"] in ("all_gather", "reduce_scatter")
        )
        if calls:
            phases["fsdp hooks"] = calls * hardware.fsdp_call_overhead
    return {p: t * (accum if p != "optimizer" else 1) for p, t in phases.items()}


def estimate_step(
    ranks: list[RankResult],
    spec: MeshSpec,
    hardware: Hardware,
    *,
    tokens_per_rank: float | None,
    shape: dict,
    accum: int = 1,
) -> StepEstimate:
    """The slowest representative rank's step on ``hardware``; see the module docstring."""
    strides = {a: spec.stride(a) for a in spec.names}
    for r in ranks:  # EP's groups within the batch axis (experts.py)
        strides.update(expert_axis_strides(spec, r.collectives.group_sizes))
    overlap = hardware.overlaps(spec.world_size)
    worst = None
    for r in ranks:
        phases = _phases(r, hardware, accum, spec.batch_axis)
        compute = sum(phases.values())
        axes = {a: t * accum for a, t in axis_seconds(r.collectives, hardware, strides).items()}
        exposed = {}
        for axis, t in axes.items():
            # DDP's buckets and FSDP2's gathers/reduce-scatters run beside forward and backward; only
            # what does not fit behind them shows. Tensor-parallel and stage traffic is on the path.
            hidden = overlap and axis == spec.batch_axis
            exposed[axis] = max(0.0, t - phases["forward"] - phases["backward"]) if hidden else t
        path = compute + sum(exposed.values())
        if r.microbatches > 1 and spec.pipe_axis:
            # 1F1B / GPipe: p - 1 extra microbatch slots of the stage's critical path (the bubble)
            p = spec.size(spec.pipe_axis)
            critical = (
                phases["forward"]
                + phases["backward"]
                + phases.get("fsdp hooks", 0.0)
                + sum(t for a, t in exposed.items() if a != spec.batch_axis)
            )
            exposed[spec.pipe_axis + " bubble"] = critical * (p - 1) / r.microbatches
            path += exposed[spec.pipe_axis + " bubble"]
        seconds = path
        if hardware.cores:
            # Processes sharing a CPU host's cores (with each other and the host's other load): the step
            # is also at least the CPU time each process asks for (compute, and loopback copies) at the
            # share of a core it gets.
            slowdown = hardware.contention(spec.world_size)
            # the link figures were measured by 2 processes at once: their share is already in them
            comm_slowdown = slowdown / max(hardware.contention(2), 1e-9) if hardware.contention_curve else slowdown
            # Communication asks the cores for what it costs on the link inside a node (memory copies); what a
            # slower link between nodes adds on top is waiting, which the core share does not stretch.
            cpu_axes = {a: t * accum for a, t in axis_seconds(r.collectives, hardware, strides, all_intra=True).items()}
            link_wait = sum(max(0.0, exposed[a] - cpu_axes.get(a, 0.0)) for a in axes)
            busy = compute * slowdown + sum(cpu_axes.values()) * max(comm_slowdown, 1.0)
            bubble = exposed.get(f"{spec.pipe_axis} bubble", 0.0)
            if bubble:
                # A pipeline's stages do not all run at once: while this stage idles in the bubble the
                # others' processes run with one stage fewer sharing the cores, and the bubble's worth of
                # this stage's own work runs while another idles. Work done with all P processes running
                # costs the P-process slowdown, the rest (a bubble's worth, twice: this stage waiting,
                # then working) that of P (p-1)/p processes. With every process on its own core it is
                # compute + bubble, the path above; when the processes share the cores in full the
                # bubble hides behind the others' work.
                p = spec.size(spec.pipe_axis)
                fewer = hardware.contention(spec.world_size * (p - 1) // p)
                busy = (
                    max(compute - bubble, 0.0) * slowdown
                    + 2 * bubble * fewer
                    + sum(cpu_axes.values()) * max(comm_slowdown, 1.0)
                )
            busy += link_wait
            if hardware.shares_cores(spec.world_size) and busy > path:
                exposed["cores shared"] = busy - path
                seconds = busy
        if worst is None or seconds > worst.seconds:
            worst = StepEstimate(compute, axes, exposed, seconds, None, phases=phases)
    if tokens_per_rank and shape.get("num_layers") and shape.get("hidden") and worst.seconds:
        per_token = 6 * shape["num_parameters"] + 12 * shape["num_layers"] * shape["hidden"] * (shape.get("seq") or 0)
        worst.mfu = per_token * tokens_per_rank * accum / (worst.seconds * hardware.flops)
    return worst


__all__ = ["StepEstimate", "estimate_step"]
